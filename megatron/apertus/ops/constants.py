"""The operators' constants that configuration reads: a module without torch, so that the
config dataclasses, and with them ``--help`` and argument errors, load without it. The operator
modules re-export them (``ops.xielu.XIELU_BETA``, ``ops.sparse_kl.TAIL_MODES``)."""

XIELU_BETA = 0.5
XIELU_EPS = -1e-6

TAIL_MODES = ("ignore", "renormalize", "rest_bucket", "label")
DEFAULT_TAIL = "label"
