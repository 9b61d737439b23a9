"""Every run of scripts/tiny_experiment.py, on every case it times, dispatches on an H200's
limits to a launch that the launch guard accepts: a run whose policy leads nowhere shows
here, on the host, and not as lost minutes on the GPU machine."""

import importlib
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

import moe_lora_align as mla
from moe_lora_align import _dispatch, _launch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
H200 = _dispatch.DeviceLimits.h200()


def _load_script(name):
    """scripts/NAME.py imported on the host, CuPy mocked (nothing runs on a GPU)."""
    fake = mock.MagicMock(name="cupy")
    with mock.patch.dict(sys.modules, {"cupy": fake, "cupy.cuda": fake}):
        sys.path.insert(0, str(SCRIPTS))
        try:
            sys.modules.pop(name, None)
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(SCRIPTS))
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def experiment():
    return _load_script("tiny_experiment")


def _job(T, K, E, B, rows, det):
    P, M = mla.buffer_sizes(T * K, E, B)
    return SimpleNamespace(numel=T * K, num_buckets=rows * E, rows=rows, padded_len=P,
                           num_tiles=M, deterministic=det)


def _dispatch_case(case, policy, det, monkeypatch):
    op, T, E, K, B, L = case
    if op == "pair":
        monkeypatch.setattr(_launch, "device_limits", lambda device_id: H200)
        _launch.choose_streams(_job(T, K, E, B, 1, det), _job(T, K, E, B, L, det), 0,
                               policy=policy)
        return
    job = _job(T, K, E, B, L or 1, det)
    _launch.checked_launch(job.numel, job.num_buckets, job.rows, H200, det, None,
                           _launch.out_entries(job), policy)


def test_every_run_dispatches_every_case(experiment, monkeypatch):
    checked = 0
    for name, settings, _, one_only, det in experiment.RUNS + [
            ("variant", experiment.ONE, None, True, False),
            ("variant det", experiment.ONE, None, False, True)]:
        policy = mla.AlignPolicy(**settings)
        for case in experiment.CASES:
            if one_only and case[2] * (case[5] or 1) > 1024:
                continue  # as tiny_experiment skips it
            try:
                _dispatch_case(case, policy, det, monkeypatch)
            except Exception as e:  # noqa: BLE001 - named with the run and case
                raise AssertionError(f"run {name!r}, case {case}: {e}") from e
            checked += 1
    assert checked > 100


def test_the_next_rounds_ab_lines_name_runs_and_cases_that_exist(experiment, monkeypatch):
    """scripts/ab_runs.txt (gpu_round.sh's `ab` step): each line names runs tiny_experiment
    has, variants it can parse, case filters that keep at least one case, and runs of its
    own (``--run``) whose policies dispatch every case they keep. A line that another
    commit's tree runs (``tree=DIR``) is checked against this tree's script."""
    path = SCRIPTS / "ab_runs.txt"
    if not path.exists():
        pytest.skip("no A/B runs are listed for the next round")
    names = {r[0] for r in experiment.RUNS}
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and ln[0] != "#"]
    assert lines
    for line in lines:
        args = shlex.split(line)
        if args[0].startswith("tree="):  # another commit's tree runs the line (gpu_round.sh)
            args = args[1:]
        opts = dict(zip(args[::2], args[1::2]))
        assert len(args) % 2 == 0 and set(args[::2]) <= {"--runs", "--cases", "--variant",
                                                          "--baseline", "--run", "--turns",
                                                          "--routing"}, line
        assert opts.get("--routing", "uniform") in ("uniform", "skewed"), line
        assert set(opts["--runs"].split(",")) <= names, line
        assert int(opts.get("--turns", 3)) >= 1, line
        parts = [p for p in opts.get("--cases", "").split("|") if p]
        for part in parts:
            assert any(part in str(case) for case in experiment.CASES), (line, part)
        kept = [c for c in experiment.CASES if not parts or any(p in str(c) for p in parts)]
        for i, word in enumerate(args):
            if word == "--variant":
                name, spec = args[i + 1].split("=", 1)
                assert name and set(spec.split(":")[1:]) <= experiment.VARIANT_FLAGS, line
                experiment.parse_variant(args[i + 1])
            if word == "--run":  # as tiny_experiment parses it
                name, settings, _, _, det = experiment.parse_run(args[i + 1])
                assert name, line
                policy = mla.AlignPolicy(**settings)
                for case in kept:
                    _dispatch_case(case, policy, det, monkeypatch)


@pytest.mark.emulator
def test_every_run_computes_every_small_case_on_the_emulator(experiment):
    """Every run's dispatcher settings give the NumPy backend's answer on the CPU emulator
    (tests/emulator), for the cases up to 1024 tokens, on the emulated device's limits: an
    A/B run that computes something wrong shows here, before any GPU time is spent."""
    import numpy as np

    import emulator
    from moe_lora_align import _call
    from moe_lora_align.testing import POISON, canonical, make_lora, segment_starts

    if not emulator.compiler_available():
        pytest.skip("needs a C++ compiler for the kernel emulator")
    emu = emulator.Emulator(emulator.build())

    def planned(op, sides, policy):
        # What the emulator would launch: runs that plan the same launches for a case compute
        # the same thing on the same inputs, so each (case, launches) runs once.
        jobs = [emulator.device_job(side[0]) for side in sides]
        with emulator.emulated(emu):
            if op != "pair":
                return repr(_launch.plan_launch(jobs[0], 0, None, policy))
            mode, pair = _launch.choose_streams(jobs[0], jobs[1], 0, None, None, policy)
            if mode == "fused":
                return repr((mode, pair))
            return repr((mode, *(_launch.plan_launch(j, 0, None, policy) for j in jobs)))

    checked, seen = 0, set()
    for name, settings, source, one_only, det in experiment.RUNS:
        assert source is None
        policy = mla.AlignPolicy(**settings)
        for op, T, E, K, B, L in experiment.CASES:
            if T > 1024:
                continue
            rng = np.random.default_rng(T * 7 + E)
            ids = rng.integers(E, size=(T, K)).astype(np.int32)
            P, M = mla.buffer_sizes(T * K, E, B)
            sides = []
            for lora, rows in {"base": [(False, 1)], "lora": [(True, L)],
                               "pair": [(False, 1), (True, L)]}[op]:
                kw = {}
                if lora:
                    mapping, lora_ids, enabled = make_lora(rng, T, rows)
                    kw = dict(lora=True, token_lora_mapping=mapping, lora_ids=lora_ids,
                              adapter_enabled=enabled)
                shapes = ((rows, P), (rows, M), (rows,)) if kw else ((P,), (M,), (1,))
                want = [np.full(sh, POISON, np.int32) for sh in shapes]
                got = [np.full(sh, POISON, np.int32) for sh in shapes]
                _call.run_on_host(_call.prepare(ids, B, E, rows=rows, out=want, **kw).job)
                job = _call.prepare(ids, B, E, rows=rows, out=got, deterministic=det, **kw).job
                starts = segment_starts(ids, E, B, rows=rows, mapping=kw.get(
                    "token_lora_mapping"), lora_ids=kw.get("lora_ids"),
                    enabled=kw.get("adapter_enabled"))
                sides.append((job, got, want, starts))
            key = ((op, T, E, K, B, L), det, planned(op, sides, policy))
            if key in seen:
                continue
            seen.add(key)
            try:
                if op == "pair":
                    emulator.run_pair(emu, sides[0][0], sides[1][0], policy=policy, seed=T)
                else:
                    emulator.run(emu, sides[0][0], policy=policy, seed=T)
                for _, got, want, starts in sides:
                    if not det:
                        got[0], want[0] = (canonical(np.atleast_2d(x), starts)
                                           for x in (got[0], want[0]))
                    for g, w in zip(got, want):
                        np.testing.assert_array_equal(g, w)
            except Exception as e:  # noqa: BLE001 - named with the run and case
                raise AssertionError(f"run {name!r}, case {(op, T, E, K, B, L)}: {e}") from e
            checked += 1
    assert checked > 100, checked  # 347 distinct of 1170 at e3d9251


def test_stage_probe_reads_every_stamp_the_kernels_write():
    """scripts/stage_probe.py names a kernel slot and a stage for every MLA_STAMP(slot,
    stage) and MLA_ARRIVE(slot, stage) in kernels/, and reads the probe buffer with the
    kernels' shape (slots, blocks, stages): a stamp it does not name would be dropped from
    the printout unseen."""
    probe = _load_script("stage_probe")
    kernels = SCRIPTS.parent / "kernels"
    source = "\n".join(f.read_text() for f in sorted(kernels.glob("*.cu*")))
    sizes = {name: int(v) for name, v in re.findall(r"#define (MLA_PROBE_\w+) (\d+)", source)}
    assert probe.SLOTS == sizes["MLA_PROBE_SLOTS"] == len(probe.KERNEL) == len(probe.STAGES)
    assert sizes["MLA_PROBE_BLOCKS"] == probe.PROBE_BLOCKS == 160
    assert sizes["MLA_PROBE_STAGES"] == probe.PROBE_STAGES == 8
    stamps = {(int(k), int(s))
              for k, s in re.findall(r"MLA_(?:STAMP|ARRIVE)\((\d+), (\d+)\)", source)}
    assert stamps
    for slot, stage in stamps:
        assert stage < len(probe.STAGES[slot]) <= sizes["MLA_PROBE_STAGES"], (slot, stage)


def test_stage_probe_lists_the_last_blocks_with_their_sms():
    """stage_probe's --by-block lines: the blocks of one kernel slot whose last stamp came
    last (global timer) first, each with its SM, its window in ns and every stage it stamped
    (SM cycles from its entry); blocks that did not stamp are left out."""
    probe = _load_script("stage_probe")
    order = list(probe.KERNEL.values()).index("order")
    b = np.zeros((probe.SLOTS, probe.PROBE_BLOCKS, probe.PROBE_STAGES, 2), np.int64)
    sms = np.full((probe.SLOTS, probe.PROBE_BLOCKS), -1, np.int64)
    # (entry cycles, end cycles, entry ns, end ns, SM): block 2 ends last by the timer,
    # block 1 has the most cycles.
    for blk, (c0, c1, t0, t1, sm) in enumerate([(100, 900, 1000, 1500, 7),
                                               (100, 3100, 1000, 2500, 8),
                                               (200, 1200, 2000, 2600, 7)]):
        b[order, blk, 0] = c0, t0
        b[order, blk, 1] = c0 + 50, t0 + 20
        b[order, blk, 5] = c1, t1
        sms[order, blk] = sm
    lines = probe.block_lines(b, sms, order, top=2)
    assert lines[0].strip() == "order by block, the 2 last of 3 (on 2 SMs):"
    assert lines[1].split() == ["block", "2", "sm", "7", "@1000-1600ns:", "warps", "50c;",
                                "end", "1000c"]
    assert lines[2].split()[:5] == ["block", "1", "sm", "8", "@0-1500ns:"]
    assert len(lines) == 3
    assert probe.block_lines(b, sms, 0, top=2) == []
