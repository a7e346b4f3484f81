"""--mixed auto's search (quantize/auto.py) on made-up verdicts: the least count that
passes, with the one below it measured failing, int8 tried before float."""

from __future__ import annotations

from mha_onnx.quantize import auto
from mha_onnx.quantize.accuracy import AccuracyReport, Thresholds
from mha_onnx.quantize.config import QuantizeConfig


def _report(kl: float) -> AccuracyReport:
    return AccuracyReport((), 1, kl_mean=kl, kl_max=kl, top1=1.0, thresholds=Thresholds())


def _search(config: QuantizeConfig, passing: dict[str, int], count: int = 21):
    """least() where keeping ``passing[form]`` or more weights in ``form`` passes."""
    ranked = [f"w{i}" for i in range(count)]
    asked = []

    def measure(wider: QuantizeConfig) -> AccuracyReport:
        form = "int8" if len(wider.int8) > len(config.int8) else "float"
        kept = len(wider.int8) - len(config.int8) or len(wider.exclude) - len(config.exclude)
        asked.append((form, kept))
        return _report(0.01 if kept >= passing.get(form, count + 1) else 1.0)

    return auto.least(config, ranked, _report(1.0), measure), asked


def test_the_least_count_that_passes():
    for least in (1, 2, 3, 5, 13, 16, 17, 21):
        search, asked = _search(QuantizeConfig(), {"int8": least})
        assert search.kept == least and search.form == "int8"
        assert ("int8", least - 1) in asked or least == 1
        assert search.config.int8 == tuple(f"w{i}" for i in range(least))
        assert len(asked) <= 2 * 5 + 1  # (doubling, then halving, over 21)


def test_float_when_int8_is_not_enough_or_the_weights_are_8_bits():
    search, asked = _search(QuantizeConfig(), {"float": 3})
    assert search.form == "float" and search.kept == 3 and ("int8", 21) in asked
    assert search.config.exclude == ("w0", "w1", "w2") and not search.config.int8
    search, asked = _search(QuantizeConfig(weights="int8"), {"float": 2})
    assert search.kept == 2 and {form for form, _ in asked} == {"float"}
    search, _ = _search(QuantizeConfig(algorithm="hqq"), {"int8": 1, "float": 4})
    assert search.form == "float" and search.kept == 4


def test_nothing_passes_or_nothing_needed():
    search, _ = _search(QuantizeConfig(), {})
    assert search.kept is None and search.config == QuantizeConfig()
    assert "no count" in search.note()
    passed = auto.least(QuantizeConfig(), ["w0"], _report(0.0), lambda c: _report(1.0))
    assert passed.kept == 0 and "as it is" in passed.note()


def test_names_are_matched_literally():
    """A weight's name goes into the config's fnmatch patterns escaped."""
    import fnmatch

    pattern = auto.widened(QuantizeConfig(), "int8", ["a[0]*"]).int8[0]
    assert fnmatch.fnmatch("a[0]*", pattern) and not fnmatch.fnmatch("a0x", pattern)
