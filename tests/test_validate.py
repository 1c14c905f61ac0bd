"""The shared argnums normalizer (jax #9969 shipped a bug from this kind of helper)."""

import pytest

from gradkit._validate import check_choice, normalize_argnums


@pytest.mark.parametrize(
    "argnums,nargs,want", [(0, 1, (0,)), (-1, 3, (2,)), ((0, 2), 3, (0, 2)), ([1, 0], 2, (1, 0))]
)
def test_valid(argnums, nargs, want):
    assert normalize_argnums(argnums, nargs, "f") == want


@pytest.mark.parametrize(
    "argnums,nargs,exc,match",
    [
        (
            2,
            2,
            ValueError,
            r"f: argnums: expected indices in \[-2, 2\) \(f was given 2 positional "
            r"arguments\), got 2",
        ),
        (-3, 2, ValueError, "expected indices"),
        ((), 2, ValueError, "at least one index"),
        ((0, 0), 2, ValueError, "distinct"),
        (True, 2, TypeError, "an int or a tuple of ints"),
        ((0, "1"), 2, TypeError, "ints"),
        (None, 2, TypeError, "an int or a tuple of ints"),
    ],
)
def test_invalid(argnums, nargs, exc, match):
    with pytest.raises(exc, match=match):
        normalize_argnums(argnums, nargs, "f")


def test_check_choice():
    assert check_choice("a", ("a", "b"), "f", "mode") == "a"
    with pytest.raises(ValueError, match="f: mode: expected one of 'a', 'b', got 3"):
        check_choice(3, ("a", "b"), "f", "mode")


def test_is_batching_error():
    from gradkit._validate import is_batching_error

    assert is_batching_error(RuntimeError("vmap: It looks like you're calling .item()"))
    assert is_batching_error(RuntimeError("Batching rule not implemented for aten::foo"))
    assert not is_batching_error(RuntimeError("CPU out of memory (tried to allocate 1 GiB)"))
    assert not is_batching_error(RuntimeError("shape mismatch"))
