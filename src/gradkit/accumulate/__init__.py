"""gradkit.accumulate: exact gradient accumulation.

* micro-batch accumulation that reproduces the large-batch gradient exactly, with automatic
  micro-batch sizing and an adaptive number of micro-batches per step;
* ``ConditionalAccumulator`` / ``SparseConditionalAccumulator`` with TensorFlow's staleness
  semantics, and a process-group version over torch.distributed.
"""

from gradkit._validate import expose
from gradkit.accumulate._conditional import *  # noqa: F403
from gradkit.accumulate._conditional import __all__ as _conditional_all
from gradkit.accumulate._micro import *  # noqa: F403
from gradkit.accumulate._micro import __all__ as _micro_all
from gradkit.accumulate._sizing import *  # noqa: F403
from gradkit.accumulate._sizing import __all__ as _sizing_all

__all__ = [*_conditional_all, *_micro_all, *_sizing_all]

expose(globals(), __all__, __name__)
