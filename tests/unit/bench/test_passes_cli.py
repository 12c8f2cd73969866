"""`python -m bench.passes`: its shapes and contexts are read as written, and a bad
one is refused naming it, before any model is loaded."""

from __future__ import annotations

import pytest

from bench import passes


def test_shapes_are_read_as_sequences_by_rows():
    assert passes.parse_shapes("16x1, 16x2,1x8") == ((16, 1), (16, 2), (1, 8))


@pytest.mark.parametrize("text, why", [("16xx", "is not SEQUENCESxROWS"), ("16", "is not SEQUENCESxROWS"),
                                       ("0x2", "needs at least one sequence and one row"),
                                       ("4x0", "needs at least one sequence and one row")])
def test_a_bad_shape_is_refused_naming_it(text, why):
    with pytest.raises(SystemExit, match=why) as e:
        passes.parse_shapes(text)
    assert repr(text) in str(e.value)


def test_a_bad_context_is_refused_before_the_model_loads(monkeypatch):
    import structspec.engine.model as model

    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("loaded a model for a bad argument"))
    with pytest.raises(SystemExit, match="--contexts: '1100,many'"):
        passes.main(["--contexts", "1100,many"])
