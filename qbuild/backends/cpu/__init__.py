"""The CPU backends, export and inductor: one class parameterised by name (backend.py), their compile params
(params.py), and the two ways a graph is compiled (export.py, inductor.py)."""
