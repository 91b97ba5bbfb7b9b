"""The operators, one family per module (shape legend, torch reference, custom op + fake, public
function), and ``backends``: which implementation runs each. Importing this package registers every
``torch.ops.mla_ops`` op and its CUDA kernel."""

from . import absorbed, attention, backends, cache, gather, indexer, merge, up_projection  # noqa: F401
