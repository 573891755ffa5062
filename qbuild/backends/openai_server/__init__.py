"""qbuild's own OpenAI-compatible server, one implementation for every runtime that serves a bundle in-process: the
CPU backends' runtime (qbuild.model.runtime) and a neuron VL bundle's runtime over the port's VL classes
(qbuild.backends.neuron.vl_runtime). serve.py holds the routes, the queue and the limits, serve_requests.py the request
schema and OpenAI's error object, serve_images.py how an image part's bytes are had, runtime.py what the server asks
of a runtime, describe.py what `qbuild serve --dry-run` says of it.

No build step serves, so no key holds these modules: the backends' servers import them for `qbuild serve` alone."""
