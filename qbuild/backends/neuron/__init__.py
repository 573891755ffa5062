"""The neuron backend, split by job: ports.py (the port lineages and where a port lives), params.py (its typed step
params), config.py (the pure NxDI configuration), driver.py (the compiles through the SDK), sdk_worker.py (what runs
inside the SDK), package.py (the bundle), deploy.py (running and serving a bundle), backend.py (the Backend)."""
