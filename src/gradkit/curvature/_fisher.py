"""Fisher information matrices ``J^T M J`` with an output matrix ``M`` from loss gradients.

Index legend: ``s`` sample, ``n`` example, ``o`` output feature (flat), ``k`` vectors.

Per example, ``M_n = c * sum_s r_sn r_sn^T`` with

* ``kind="mc"``: ``r_sn`` the gradient w.r.t. the output of the negative log-likelihood at a
  target drawn from the model's predictive distribution (categorical for cross entropy, Gaussian
  for MSE, or a ``likelihood`` callable), ``c = w / S`` with ``w`` the loss's weight of each
  example's negative log-likelihood (``1/N`` for a mean cross entropy), found from the loss
  itself and checked; its expectation is the GGN. Examples whose real target the loss ignores
  (``ignore_index``) are left out of the categorical samples, as the GGN leaves them out;
* ``kind="empirical"``: ``r_n`` the gradient of the loss w.r.t. the output at the real targets,
  ``c = Z_b`` (mean: what the batch's mean divides by, ``n_b``, its counted targets, or its
  ``n_b * D`` entries for an MSE) or 1 (sum), so that ``F = (1/Z) sum_n g_n g_n^T`` (mean) or
  ``sum_n g_n g_n^T`` (sum) for the individual gradients ``g_n = d l_n / d theta`` (``l_n`` the
  terms of the summed loss in example ``n``'s output row: all its targets, a sequence's tokens
  together).

Products go through ``J`` and ``J^T`` as for the GGN; ``M`` is applied from its factors.
Targets are sampled once per batch from a seed fixed at construction, so every product of an
operator uses the same samples (a fixed symmetric matrix, safe for Lanczos).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradkit._errors import GradkitError, describe, message
from gradkit._layouts import sequence_first_layer
from gradkit._validate import check_choice, check_int
from gradkit.curvature._base import CurvatureOperator, Point
from gradkit.curvature._data import LossFn, _batch_size, check_generator
from gradkit.curvature._diag import check_rows, factor_diagonal
from gradkit.curvature._ggn import JPoint

__all__ = ["Fisher"]

Likelihood = str | Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def _infer(loss_fn: Any) -> str | None:
    if loss_fn is F.cross_entropy or isinstance(loss_fn, nn.CrossEntropyLoss):
        return "categorical"
    if loss_fn is F.mse_loss or isinstance(loss_fn, nn.MSELoss):
        return "gaussian"
    return None


class _FactorPoint(Point):
    def __init__(self, j: JPoint, R: torch.Tensor, c: float | torch.Tensor) -> None:
        self.j, self.c = j, c
        self.unused, self.errors = j.unused, j.errors
        self._R = R.reshape(R.shape[0], R.shape[1], -1)  # [s, n, o]

    def _apply_m(self, U: torch.Tensor) -> torch.Tensor:  # U [k, n, ...]
        Uf = U.reshape(U.shape[0], U.shape[1], -1)
        coeff = torch.einsum("kno,sno->ksn", Uf, self._R)
        return (self.c * torch.einsum("ksn,sno->kno", coeff, self._R)).reshape(U.shape)

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        return self.j.vjp(self._apply_m(self.j.jvp(v)[None])[0])

    def apply_batched(self, V: torch.Tensor) -> torch.Tensor:
        return self.j.vjp(self._apply_m(self.j.jvp(V, True)), True)


class Fisher(CurvatureOperator):
    r"""The Fisher information matrix, Monte Carlo (``kind="mc"``) or empirical, matrix-free.

    .. math:: F_\text{mc} = \sum_n J_n^\top \Big(\frac{w}{S} \sum_{s=1}^S
              \nabla_f \log p(\hat y_{ns} | f_n)\, \nabla_f \log p(\hat y_{ns} | f_n)^\top\Big)
              J_n, \quad \hat y_{ns} \sim p(\cdot | f_n)

    .. math:: F_\text{emp} = \frac1Z \sum_n g_n g_n^\top \text{ (mean)},\quad
              \sum_n g_n g_n^\top \text{ (sum)}, \qquad g_n = \nabla_\theta\, l_n

    (``Z = N``, or what the mean of a torch loss divides by, as for :class:`Hessian`: the
    counted targets of a classification loss, the ``N * D`` entries of an MSE; ``l_n`` the
    terms of example ``n`` in the summed loss, all its targets together: a sequence's tokens).
    The examples whose real target a cross entropy ignores (``ignore_index``) are left out of
    the Monte Carlo Fisher, as the GGN leaves them out.

    ``E[F_mc] = GGN`` for cross entropy and MSE (exponential families in the natural
    parameters); the empirical Fisher is a different matrix. Products cost about 2x a gradient
    (through ``J`` and ``J^T``, like :class:`GGN`); :func:`diagonal` is exact from per-example
    gradients.

    Args:
        model, loss_fn, data, params, blocks, reduction, vectorize, chunk_size: as for
            :class:`Hessian` (the model returns one tensor, examples along dimension 0).
        kind: ``"mc"`` or ``"empirical"``.
        samples: targets drawn per example (``kind="mc"``).
        likelihood: the predictive distribution for ``kind="mc"``: ``"categorical"`` (logits
            ``[N, C]``, cross entropy), ``"gaussian"`` (MSE), or a callable
            ``(output, generator) -> targets`` drawing from it; then ``loss_fn`` must be the
            negative log-likelihood times ``1/n_b`` (reduction ``"mean"``) or 1 (``"sum"``).
            Default: inferred from ``F.cross_entropy``/``nn.CrossEntropyLoss`` and
            ``F.mse_loss``/``nn.MSELoss``.
        generator: a ``torch.Generator`` for the samples (default: seeded from torch's global
            generator, so ``torch.manual_seed`` makes it reproducible).

    Returns:
        A :class:`CurvatureOperator` of shape ``(P, P)``.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from gradkit.curvature import Fisher
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = nn.Linear(3, 4)
        >>> x, y = torch.randn(8, 3), torch.randint(0, 4, (8,))
        >>> F_emp = Fisher(model, nn.functional.cross_entropy, (x, y), kind="empirical")
        >>> F_mc = Fisher(model, nn.functional.cross_entropy, (x, y), samples=10)
        >>> F_emp.shape, (F_mc @ torch.ones(16)).shape
        ((16, 16), torch.Size([16]))
    """

    _kind = "Fisher"

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        data: Any,
        *,
        kind: str = "mc",
        samples: int = 1,
        likelihood: Likelihood | None = None,
        generator: torch.Generator | None = None,
        params: Iterable[str] | str | None = None,
        blocks: Any = "full",
        reduction: str = "mean",
        vectorize: bool | None = None,
        chunk_size: int | None = None,
    ) -> None:
        self._options = (kind, samples, likelihood, generator)  # checked in _configure
        super().__init__(
            model,
            loss_fn,
            data,
            params=params,
            blocks=blocks,
            reduction=reduction,
            vectorize=vectorize,
            chunk_size=chunk_size,
        )

    def _configure(self) -> None:
        call = self._call
        kind, samples, likelihood, generator = self._options
        self.kind = check_choice(kind, ("mc", "empirical"), call, "kind")
        samples = check_int(samples, call, "samples", low=1)
        if kind == "empirical" and samples != 1:
            raise ValueError(
                message(
                    call,
                    "samples",
                    "1 for kind='empirical' (it uses the real targets)",
                    repr(samples),
                    "drop samples=, or use kind='mc'",
                )
            )
        self.samples = samples
        self._sequence_first = sequence_first_layer(self._data.model) is not None
        if kind == "empirical":
            self._data.warn_sequence_first(
                "the empirical Fisher takes the gradients of examples",
                "Pass batch-first batches (transposed outside the model).",
                stacklevel=4,
            )
        generator = check_generator(generator, call)
        self.likelihood: Likelihood | None = None
        self._mse = _infer(self._data.loss_fn) == "gaussian"  # torch's MSE: a mean over entries
        if kind == "mc":
            lik = _infer(self._data.loss_fn) if likelihood is None else likelihood
            if lik is None:
                raise ValueError(
                    message(
                        call,
                        "likelihood",
                        "'categorical', 'gaussian' or a callable (output, generator) -> targets "
                        "(it cannot be inferred from this loss_fn)",
                        "None",
                        "pass likelihood= the predictive distribution whose negative "
                        "log-likelihood loss_fn computes",
                    )
                )
            if not callable(lik):
                check_choice(lik, ("categorical", "gaussian"), call, "likelihood")
            self.likelihood = lik
        # the seed of the sampled targets, drawn only where targets are sampled: the empirical
        # Fisher leaves the caller's random stream as it was
        self._seed = 0
        if self.kind == "mc":
            kw: dict[str, Any] = {"dtype": torch.int64, "device": "cpu"}
            if generator is not None:
                kw.update(generator=generator, device=generator.device)
            self._seed = int(torch.randint(0, 2**62, (), **kw))

    def _by_examples(self) -> bool:
        # the Monte Carlo Fisher of a Gaussian or a callable likelihood is a mean over the
        # batch's examples at sampled targets, whatever the real targets say
        return self.kind == "mc" and self.likelihood != "categorical"

    def _make_point(self, inputs: Any, targets: torch.Tensor, index: int) -> Point:
        j = JPoint(self._layout, self._data, inputs)
        if self.kind == "empirical" and not self._sequence_first:
            # (a sequence-first model's inputs hold the examples in dimension 1: warned about)
            check_rows(
                j.out,
                _batch_size(inputs, self._call),
                self._call,
                purpose="for the empirical Fisher, built from each example's gradient",
                other="",
            )
        R, c = self._factor(j.out.detach(), targets, index)
        return _FactorPoint(j, R, c)

    def _exact_diagonal(self, *, max_size: int, max_memory: int, call: str) -> torch.Tensor:
        def factors(
            out: torch.Tensor, targets: torch.Tensor, index: int
        ) -> tuple[torch.Tensor, torch.Tensor]:
            R, c = self._factor(out, targets, index)
            return R * c**0.5, R[:0]

        return factor_diagonal(self._data, self._layout, factors, call=call)

    # -- the output factors ------------------------------------------------------------------

    def _loss_grad(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        od = out.detach().requires_grad_(True)
        with torch.enable_grad():
            (r,) = torch.autograd.grad(self._data.loss(od, targets), od, allow_unused=True)
        return torch.zeros_like(od) if r is None else r

    def _factor(
        self, out: torch.Tensor, targets: torch.Tensor, index: int
    ) -> tuple[torch.Tensor, float | torch.Tensor]:
        n = out.shape[0]
        per_example = float(n) if self._data.reduction == "mean" else 1.0
        if self.kind == "empirical":
            divisor = self._data.divisor(targets)  # Z_b of a mean classification loss
            c: float | torch.Tensor = per_example if divisor is None else divisor
            if divisor is None and self._data.reduction == "mean" and self._mse:
                c = float(out.numel())  # a mean over every entry, not over the rows
            return self._loss_grad(out, targets)[None], c
        gen = torch.Generator(device=out.device).manual_seed(self._seed + index)
        lik = self.likelihood
        S = self.samples
        if callable(lik):
            R = torch.stack([self._loss_grad(out, lik(out.detach(), gen)) for _ in range(S)])
            return R, per_example / S
        if lik == "categorical":
            if out.dim() != 2:
                raise ValueError(
                    message(
                        self._call,
                        "likelihood",
                        "logits of shape [N, C] for likelihood='categorical'",
                        describe(out),
                        "pass likelihood= a callable (output, generator) -> targets",
                    )
                )
            p = torch.softmax(out, dim=1)
            idx = torch.multinomial(p, S, replacement=True, generator=gen)  # [n, s]
            R = p[None] - F.one_hot(idx.T, out.shape[1]).to(out.dtype)
            first = idx[:, 0]
            soft = targets.is_floating_point() and targets.shape == out.shape
            y0 = F.one_hot(first, out.shape[1]).to(out.dtype) if soft else first
            ignored = self._data.ignored(targets)
            if ignored is not None and ignored[0].shape == first.shape:
                # the GGN leaves out the examples the loss ignores: so do the samples
                mask, value = ignored
                R = R.masked_fill(mask[None, :, None], 0.0)
                y0 = first.masked_fill(mask, value)
        else:
            eps = torch.randn((S, *out.shape), generator=gen, dtype=out.dtype, device=out.device)
            R, y0 = -eps, out + eps[0]
        return R, self._weight(out, y0, R[0]) / S

    def _weight(self, out: torch.Tensor, y0: torch.Tensor, g0: torch.Tensor) -> float:
        """``w`` with ``dloss/doutput = w * g0`` at targets ``y0``, ``g0`` the gradient of the
        negative log-likelihood (checked: the loss must be a multiple of it)."""
        r = self._loss_grad(out, y0)
        if not bool(g0.any()) and not bool(r.any()):  # every example left out (ignored)
            return 0.0
        w = float((r * g0).sum() / (g0 * g0).sum().clamp_min(1e-300))
        dev = float((r - w * g0).abs().max())
        tol = torch.finfo(out.dtype).eps ** 0.5 * float(r.abs().max())
        if not w > 0 or dev > tol:
            raise GradkitError(
                message(
                    self._call,
                    "likelihood",
                    f"a loss_fn that is a positive multiple of the {self.likelihood} negative "
                    "log-likelihood",
                    f"gradients w.r.t. the output that deviate by {dev:.3g} (tolerance "
                    f"{tol:.3g}) from it",
                    "pass likelihood= a callable (output, generator) -> targets for this loss "
                    "(label smoothing, class weights and ignore_index change the likelihood)",
                )
            )
        return w
