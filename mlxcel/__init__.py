"""mlxcel: an LLM inference server on MLX.

``import mlxcel`` stays light: it never imports mlx or the server. The Python client
(``mlxcel.LLM``) lives here once it lands; the server is ``python -m mlxcel serve``.
"""

__version__ = "0.1.0"
