"""gradkit.curvature: matrix-free Hessian, GGN and Fisher operators with safe estimators.

* Operators on ``(model, loss_fn, data)``: :class:`Hessian`, :class:`GGN`, :class:`Fisher`
  (Monte Carlo or empirical), all :class:`CurvatureOperator`: ``op @ v``, ``op @ V``,
  ``op.dense()``, ``op.to_scipy()``, full or block-diagonal, one batch or many.
* Functions on operators: :func:`diagonal` (exact where cheap, Hutchinson, Hutch++),
  :func:`trace` (Hutch++, Hutchinson, exact), :func:`eigenvalues` (Lanczos with full
  reorthogonalization), :func:`spectral_density` (stochastic Lanczos quadrature),
  :func:`solve` (conjugate gradients on ``op + damping``: Newton-CG, natural gradients,
  influence functions).
"""

from gradkit._validate import expose
from gradkit.curvature._base import CurvatureOperator
from gradkit.curvature._estimators import Estimate, diagonal, trace
from gradkit.curvature._fisher import Fisher
from gradkit.curvature._ggn import GGN
from gradkit.curvature._hessian import Hessian
from gradkit.curvature._lanczos import SpectralDensity, eigenvalues, spectral_density
from gradkit.curvature._solve import ConvergenceWarning, ShiftedOperator, Solution, solve

__all__ = [
    "GGN",
    "ConvergenceWarning",
    "CurvatureOperator",
    "Estimate",
    "Fisher",
    "Hessian",
    "ShiftedOperator",
    "Solution",
    "SpectralDensity",
    "diagonal",
    "eigenvalues",
    "solve",
    "spectral_density",
    "trace",
]

expose(globals(), __all__, __name__)
