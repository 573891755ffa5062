"""The neuron backend, split by job: ports.py (the port lineages and where a port lives), params.py (its typed step
params), config.py (the pure NxDI configuration), driver.py (the compiles through the SDK), sdk_worker.py (what runs
inside the SDK), package.py (the bundle), deploy.py (running a bundle for verify), backend.py (the Backend); serving a
bundle: serving.py (which server), vl_serve.py and vl_runtime.py (qbuild's server over the port's VL classes),
vllm_serve.py, vllm_plugin.py and vllm_images.py (vLLM's Neuron plugin), server_process.py (the server's process)."""
