"""Every bench in ``bench/`` runs end to end in its smoke mode and ends with its headline.

``bench/X.py --smoke`` (bench/smoke.py) runs the bench's own code path, peer and whalelike sides
and checks included, at tiny sizes in seconds; here each runs as Python runs a script (its own
``__main__``, argv, working directory the repository root, this environment, its exit status) in a
fresh process that starts with torch and the library imported (``tests/bench_runner.py``: a cold
interpreter spends about 5 s of CPU importing them, more than most smoke runs). Its figures
mean nothing, so the test asserts only that it exits 0, that its last line is its headline (the
line that states the ratio, in the bench's own words), and that no correctness check it prints
failed (equal losses, exact tensors, equal padded work). The benches that start ranks pick no
fixed port (``file://`` rendezvous, or ``bench/timing.py``'s ``free_port``), so two of these
tests can run at once under pytest-xdist.

A new bench (a ``bench/*.py`` with a ``__main__`` block) needs its headline pattern below:
:func:`test_every_bench_has_a_smoke_test` fails until it has one.
"""
from __future__ import annotations

import os
import pathlib
import re

import pytest

from bench_runner import run_bench

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TIMEOUT_S = 300   # a smoke run takes seconds; the rest is headroom for a machine busy with other tests
# benches whose smoke run is a whole job: real_job's ends with a 4-rank torchrun job of whalelike train
TIMEOUT_OVERRIDE_S = {"real_job": 600}

_X = r"\d+\.\d\dx"   # a ratio as the benches print it: 1.49x
HEADLINES = {        # bench: its last line (re.fullmatch)
    "real_job": rf"real_job: zero3 set-up peak today/whalelike >= {_X}, whalelike {_X} of share\+layer, set-up {_X} "
                rf"faster; pipeline set-up peak today/whalelike >= {_X}, whalelike {_X} of share\+layer, set-up {_X} "
                r"faster; whalelike train [\d,]+ tokens/s, MFU .* \(target <= 1\.10x share\+layer: (yes|NO)\)",
    "tp_moe": rf"whalelike / equal experts per rank speed-up: speeds 1/0\.5 {_X} .*; equal speeds {_X} .*",
    "checkpoint_cost": rf"checkpoint cost: whalelike save .* ms = {_X} DDP\+DCP's, async stall .* = {_X} "
                       rf"dcp\.async_save's \(.* steps\), load {_X}",
    "dp_vs_ddp": rf"headline: emulated-4 {_X} = .* of the ideal {_X}; emulated-4-equal {_X} = .*; "
                 rf"two-hosts {_X} = .* of the ideal {_X}",
    "overhead": r"overhead: one rank \d+/\d+ within target, worst -?\d+\.\d\d ms per step; \d+ ranks whalelike "
                r"\d+\.\d{3}x DDP \(DDP \d+\.\d{3}x itself\) \(target >= 0\.99\)",
    "pipeline_comm": rf"headline: eager-1F1B \+ resharding auto is {_X} faster than 1F1B \+ send/recv .*; "
                     r"exact: yes",
    "plan_scale": r"fixed +\d+ +\d+\.\d+ % +\d+\.\d+ % .*",   # (2)'s last row: greedy's gap to the ILP
    "elastic": r"elastic: \(a\) restart \+ hand-made plan: \d+ steps lost, \d+\.\d s to the next step, throughput "
               rf"after {_X} the ideal; \(b\) automatic re-plan on restart: \d+ steps lost, \d+\.\d s to the next "
               rf"step, throughput after {_X} the ideal; \(c\) leaving without a restart: 0 steps lost, \d+\.\d s to "
               rf"the next step, throughput after {_X} the ideal; leaving {_X} faster than \(a\); leaving {_X} "
               r"faster than \(b\)",
    "gpu_check": rf"gpu-check on .*: bf16 {_X} fp32's speed; measured/predicted memory fp32 \d+\.\d\d, bf16 "
                 r"\d+\.\d\d, fp16 \d+\.\d\d, bf16\+recompute \d+\.\d\d; recompute cut bf16's measured peak by "
                 r"-?\d+%; all losses match their references",
    "lab_plans": r"lab_plans: \d+/\d+ cases planned, the longest in \d+\.\d s \(target < 30 s\); idle devices \d+; 7B on "
                 r"lab-mixed (not run|fits|does NOT fit); plan / best single kind (n/a|\d+\.\d\d-\d+\.\d\dx)"
                 r"( \(lab-mixed \d+\.\d\dx, target >= 1\.30x, where all its devices' FLOP/s are \d+\.\d\dx the "
                 r"best kind's\))?; plan / bound (n/a|\d+%-\d+%)",
    "memory": rf"memory: largest global batch fp32 \d+, bf16 \d+ \({_X}\), bf16\+recompute \d+ \({_X}\); measured / "
              r"predicted per rank \d+\.\d\d-\d+\.\d\d \(target within 10%: (yes|NO)\)",
    "pipeline_shares": r"pipeline_shares \((demo|hf_gpt2)\): a shares-only re-plan's switch takes \d+\.\d ms in place vs "
                       rf"\d+\.\d ms rebuilding the executor \(\d+x\); .*; executor kept, losses identical",
    "pp_vs_pipelining": rf"  speed-up whalelike / pipelining: {_X}",
    "prague": rf"prague: \d+ ranks, under \d+x slowdowns smart P-Reduce {_X} all-reduce's throughput = \d+% of its "
              rf"no-wait bound {_X} \(targets >= 1\.8x, >= 90%\), static {_X}; .*; calm smart {_X}, static {_X} "
              r"\(target >= 0\.95x\); time to "
              r"target smart .*; policy \d+\.\d\d of the best side \(target >= 0\.95\)",
    "precision": rf"headline: fp16 on .*, the plan priced per dtype trains {_X} the throughput of the plan priced "
                 rf"from FP32 peaks \(.*\) = \d+% of the ideal {_X} from the emulated rates and shares; losses agree",
    "profile_examples": r"profile_examples: \d+ of \d+ examples within 3% of the predicted step time; errors .*; worst "
                        r"\w+ [+-]\d+\.\d%",
    "profile_vs_spec": rf"profile_vs_spec: .*: profiled plan {_X} the spec plan's speed, step predicted [+-]\d+\.\d% "
                       rf"\(spec plan [+-]\d+\.\d%\), profiled in \d+ s.* \(targets >= 1\.2x, within 3%; Poplar "
                       r"profiles in 67-174 s\)",
    "replan_speed": r"rebalance\(\) on 8 devices, .*: median \d+\.\d ms .*takes \d+\.\dx as long \(median\)",
    "resharding": rf"headline: broadcast is {_X} faster than send/recv .*, {_X} with 8 receivers .*",
    "straggler_dp": rf"straggler_dp: adaptive \d+\.\d\d of ideal .*, {_X} over static, .*, losses identical",
    "straggler_pp": rf"straggler_pp: adaptive {_X} over static .*, losses identical",
    "straggler_tp": rf"straggler_tp chi=8: best lossless \((migrate|reshard)\) {_X} over static .*; lossless "
                    r"runs' final losses within .* of exact",
    "tp_overlap": rf"headline: overlapping the column-parallel input-gradient all-reduce is {_X} faster .*; "
                  r"exact: yes",
    "tp_transformer": rf"whalelike / DTensor speed-up: speeds 1/0\.5 {_X} .*; equal speeds {_X} .*",
    "tp_vs_dtensor": rf"speeds 1, 0\.5 +\d+\.\d +\d+\.\d +\[\d+, \d+\] +{_X} +\d+/\d+",
    "zero_bubble": rf"zero_bubble: predicted bubble ZB-H1 \d+\.\d% = \d+\.\d\dx 1F1B's \d+\.\d% \(target <= 0\.50x\), "
                   rf"\d+\.\d\dx eager-1F1B's .*; measured step ZB-H1 .* of predicted \(target within 3%\), .*; "
                   r"auto kept (zb-h1|1f1b); programs as simulated: yes; exact: yes",
    "zero_hetero": rf"zero_hetero: whalelike ZeRO-\d {_X} FSDP2-even \(\d+% of ideal \d\.\d\dx; target >= 2x and "
                   rf">= 90%\), {_X} Poplar's choice; largest model \d+ / \d+ / \d+ blocks; step measured / predicted "
                   r"\d+\.\d\d \(whalelike\), memory measured / predicted \d+\.\d\d-\d+\.\d\d",
    "update_rate": r"update_rate: .*, measured / counted passes \d+\.\d\d-\d+\.\d\d \(sgd .*: foreach/per parameter\)"
                   r"(; measured / predicted from the data sheet \d+\.\d\d-\d+\.\d\d)?",
    "whale_setting": rf"headline: predicted speed-up .*: DP {_X} at 25 Gb/s, {_X} at 100 Gb/s .*, "
                     rf"pipeline {_X} .*",
}
# what the benches print when a check of correctness fails (anywhere in the output)
FAILED_CHECKS = ("LOSSES DIFFER", "losses DIFFER", "NOT every side", "exact: NO", "exact: no",
                 "EXACTNESS FAILED", "NOTE: the sides padded different", "gradients on both sides: NO",
                 "MODELED COMPUTE DIFFERS")
# a bench starts its own ranks: rendezvous variables inherited from a launcher would make
# dp_vs_ddp.py believe it runs under torchrun, and benches share one emulated-network ledger
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def bench_scripts() -> list[str]:
    """The bench scripts: ``bench/*.py`` meant to be run (helpers such as timing.py are imported)."""
    return sorted(p.stem for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def test_every_bench_has_a_smoke_test():
    assert bench_scripts() == sorted(HEADLINES)


@pytest.mark.parametrize("name", sorted(HEADLINES))
def test_bench_smoke_run_ends_with_its_headline(name):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    run = run_bench(name, ["--smoke"], env, TIMEOUT_OVERRIDE_S.get(name, TIMEOUT_S))
    story = f"\n--- stdout (end):\n{run.stdout[-4000:]}\n--- stderr (end):\n{run.stderr[-6000:]}"
    assert run.returncode == 0, f"bench/{name}.py --smoke exited with {run.returncode}{story}"
    lines = run.stdout.rstrip("\n").splitlines()
    assert lines and lines[-1].strip(), f"bench/{name}.py --smoke printed no headline{story}"
    assert re.fullmatch(HEADLINES[name], lines[-1]), \
        f"bench/{name}.py --smoke: the last line is not its headline:\n{lines[-1]}{story}"
    failed = [marker for marker in FAILED_CHECKS if marker in run.stdout]
    assert not failed, f"bench/{name}.py --smoke: a check failed ({failed}){story}"
