"""CPU checks of benchmarks/power_probe.py: bad arguments are refused before any GPU work, and
the table puts each fraction's throughput against the first row's."""
import pytest

from benchmarks import power_probe as pp


@pytest.mark.parametrize("argv", [["--zero-fractions", "0", "1.5"], ["--zero-fractions", "-0.1"],
                                  ["--shape", "8192", "8192", "100"], ["--shape", "0", "16", "16"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        pp.main(argv)
    err = capsys.readouterr().err
    assert "--zero-fractions" in err or "--shape" in err


def test_table_ratios_and_missing_samples():
    rows = [dict(m=4096, n=2048, k=1024, zero_fraction=0.0, tflops=1000.0, sm_mhz=1400.0, power_w=690.0,
                 cold_tflops=1200.0),
            dict(m=4096, n=2048, k=1024, zero_fraction=0.5, tflops=1100.0, sm_mhz=None, power_w=None)]
    lines = pp.table(rows).splitlines()
    first, second = lines[1].split(), lines[2].split()
    assert first[0] == "4096x2048x1024" and first[3] == "1.000" and first[-1] == "1200"
    assert second[1] == "0.50" and second[3] == "1.100" and second[4:] == ["-", "-", "-"]


def test_stopped_sampler_medians():
    class Fake:
        def terminate(self):
            pass

        def communicate(self, timeout):
            return "1300, 690.5\n1500, 700.0\nbad line\n1400, 695.0\n", ""

    assert pp.stop_samples(Fake()) == (1400.0, 695.0)
    assert pp.stop_samples(None) == (None, None)
