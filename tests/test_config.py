"""Config loading: TOML, --set overrides, clear errors naming key and file."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tomllib

from trainguard.config import Config, ConfigError, dump_config, load_config, parse_duration, split_cli_args


def write(tmp_path, text: str):
    p = tmp_path / "train.toml"
    p.write_text(text)
    return p


def test_file_and_overrides(tmp_path):
    p = write(tmp_path, "[checkpoint]\ninterval = 50\n[stop]\nmax_duration = '1h30m'\n")
    cfg = load_config(p, ["checkpoint.keep_last=5", "run.dir=/data/run 1", "stop.kill_switch=STOP"])
    assert cfg.checkpoint.interval == 50 and cfg.checkpoint.keep_last == 5
    assert str(cfg.run.dir) == "/data/run 1" and cfg.stop.kill_switch == "STOP"
    assert cfg.stop.max_duration == 5400.0


def test_unknown_key_suggests_nearest(tmp_path):
    p = write(tmp_path, "[checkpoint]\nintervl = 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "unknown key 'intervl'" in msg and "did you mean 'interval'" in msg


def test_unknown_section_and_override_source(tmp_path):
    with pytest.raises(ConfigError, match=r"--set: unknown key 'chekpoint'.*did you mean 'checkpoint'"):
        load_config(None, ["chekpoint.interval=5"])


@pytest.mark.parametrize(
    "text,key",
    [
        ("[checkpoint]\ninterval = 'often'\n", "checkpoint.interval"),
        ("[checkpoint]\ninterval = -5\n", "checkpoint.interval"),
        ("[checkpoint]\nkeep_last = 0\n", "checkpoint.keep_last"),
        ("[stop]\nmax_duration = 'soon'\n", "stop.max_duration"),
        ("[preemption]\nsignals = ['SIGFOO']\n", "preemption.signals"),
        # not finite: inf seconds overflow the timers, a NaN timeout never expires
        ("[launcher]\nmonitor_interval = inf\n", "launcher.monitor_interval"),
        ("[supervisor]\nkill_grace = inf\n", "supervisor.kill_grace"),
        ("[recovery]\ntimeout = inf\n", "recovery.timeout"),
        ("[supervisor]\nstep_timeout = nan\n", "supervisor.step_timeout"),
        ("[stop]\nmax_duration = inf\n", "stop.max_duration"),
        # 0 would stop at every check: one step per launch, requeued forever
        ("[stop]\nmax_duration = 0\n", "stop.max_duration"),
        # the launcher deletes a save switch it finds: never outside the run directory
        ("[stop]\nsave_switch = '/etc/hostname'\n", "stop.save_switch"),
        ("[stop]\nkill_switch = '../KILL'\n", "stop.kill_switch"),
    ],
)
def test_bad_values_name_key_and_file(tmp_path, text, key):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert key in str(e.value) and str(p) in str(e.value)


def test_malformed_toml_names_file(tmp_path):
    p = write(tmp_path, "[checkpoint\ninterval = 5\n")
    with pytest.raises(ConfigError, match=rf"malformed TOML in {p}"):
        load_config(p)


def test_a_config_file_that_is_not_utf8_is_named_as_such(tmp_path):
    p = tmp_path / "config.toml"
    p.write_bytes(b"[run]\n# caf\xe9 (latin-1)\n")
    with pytest.raises(ConfigError, match=rf"config file {p} is not UTF-8 text"):
        load_config(p)


def test_missing_file_and_bad_set():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/train.toml")
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["interval"])


@pytest.mark.parametrize(
    "value,seconds", [(90, 90.0), ("90s", 90.0), ("2h", 7200.0), ("1d1m", 86460.0), ("01:30:00", 5400.0), (None, None)]
)
def test_parse_duration(value, seconds):
    assert parse_duration(value) == seconds


def test_split_cli_args():
    path, sets, rest = split_cli_args(["--config", "a.toml", "--set", "x.y=1", "--set=z.w=2", "pos"])
    assert (path, sets, rest) == ("a.toml", ["x.y=1", "z.w=2"], ["pos"])


def test_dump_config_round_trip(tmp_path):
    cfg = load_config(None, ["checkpoint.interval=7", "stop.max_duration=60"])
    dump_config(cfg, tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml")
    assert again == cfg
    assert tomllib.loads((tmp_path / "config.toml").read_text())["checkpoint"]["interval"] == 7


def test_cli_bad_config_exit_code_2(tmp_path):
    p = write(tmp_path, "[checkpoint]\ninterval = -1\n")
    script = tmp_path / "train.py"
    script.write_text("print('should not run')\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard.cli",
            "run",
            "--run-dir",
            str(tmp_path / "run"),
            "--config",
            str(p),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "checkpoint.interval" in r.stderr and "should not run" not in r.stdout


def test_script_arguments_other_than_config_and_set_are_refused():
    from trainguard.config import config_from_argv

    with pytest.raises(
        ConfigError, match=r"unexpected arguments \['--inject', 'nan_loss:rank=1,step=5'\].*before the script name"
    ):
        config_from_argv(Config, ["--set", "run.seed=1", "--inject", "nan_loss:rank=1,step=5"])


# ------------------------------------------------------------------------------------------------
# byte sizes (pydantic ByteSize), enum-like keys (Literal), key=value parsing, atomic writes


@pytest.mark.parametrize(
    "value,size",
    [
        (2048, 2048),
        ("'20GiB'", 20 * 2**30),
        ("'2GB'", 2 * 10**9),
        ("'1.5 gib'", int(1.5 * 2**30)),
        ("'512MiB'", 512 * 2**20),
        ("2e10", 2 * 10**10),
    ],
)
def test_byte_sizes(tmp_path, value, size):
    p = write(tmp_path, f"[memory]\nrss_limit = {value}\ngpu_free_min = {value}\n")
    cfg = load_config(p)
    assert cfg.memory.rss_limit == size and cfg.memory.gpu_free_min == size and isinstance(cfg.memory.rss_limit, int)
    again = tmp_path / "again.toml"
    dump_config(cfg, again)
    assert tomllib.loads(again.read_text())["memory"]["rss_limit"] == size  # written as a plain integer


@pytest.mark.parametrize(
    "value,expected",
    [
        ("'lots'", "expected a size such as 1073741824, '512MiB' or '2GB'"),
        ("'3 gigs'", "expected a size such as"),
        ("-5", "expected a size such as"),
        ("1.5", "expected a size such as"),  # a fraction of a byte
        ("true", "expected a size in bytes, not a boolean"),
        ("0", "greater than 0"),
    ],
)
def test_bad_byte_sizes_name_file_key_and_expectation(tmp_path, value, expected):
    p = write(tmp_path, f"[memory]\ngpu_free_min = {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "memory.gpu_free_min" in msg and expected in msg, msg


def test_empty_byte_size_unsets_it(tmp_path):
    p = write(tmp_path, "[memory]\nrss_limit = '8GiB'\n")
    assert load_config(p).memory.rss_limit == 8 * 2**30
    assert load_config(p, ["memory.rss_limit="]).memory.rss_limit is None


def test_parse_bytes_outside_a_section():
    from trainguard.config import parse_bytes

    assert (parse_bytes("1.5GiB"), parse_bytes(7), parse_bytes(None), parse_bytes("")) == (
        int(1.5 * 2**30),
        7,
        None,
        None,
    )
    with pytest.raises(ValueError, match="expected a size such as"):
        parse_bytes("lots")


@pytest.mark.parametrize(
    "text,key,allowed",
    [
        ("[checkpoint]\nverify = 'fast'\n", "checkpoint.verify", "'full' or 'size'"),
        ("[[faults.inject]]\nkind = 'rank_hang'\nrank = 0\n", "faults.inject.0.kind", "'rank_killed', 'rank_hung'"),
        (
            "[[faults.inject]]\nkind = 'rank_hung'\nhang = 'forever'\n",
            "faults.inject.0.hang",
            "'sigstop', 'collective' or 'spin'",
        ),
        ("[[faults.inject]]\nkind = 'oom'\nphase = 'optimizer'\n", "faults.inject.0.phase", "'forward' or 'backward'"),
        ("[instability]\nloss_spike = 'ignore'\n", "instability.loss_spike", "'warn', 'skip', 'rollback' or 'raise'"),
    ],
)
def test_enum_keys_name_the_allowed_values(tmp_path, text, key, allowed):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and key in msg and allowed in msg, msg


def test_key_value_parsing():
    from trainguard.config import parse_key_values, parse_override, parse_value, split_key_value

    assert parse_key_values(" rank = 1 ,step=30,, hang=collective ", "--inject x") == {
        "rank": "1",
        "step": "30",
        "hang": "collective",
    }
    assert parse_key_values("", "--rdzv-conf ''") == {}
    assert split_key_value("url=http://h/?a=b", "x") == ("url", "http://h/?a=b")  # split at the first '='
    with pytest.raises(ConfigError, match=r"^--rdzv-conf 'a=1,b': expected key=value,\.\.\.$"):
        parse_key_values("a=1,b", "--rdzv-conf 'a=1,b'")
    with pytest.raises(KeyError, match="watch setting '=5': expected key=value"):
        split_key_value("=5", "watch setting '=5'", error=KeyError)
    assert (
        parse_value("20"),
        parse_value("true"),
        parse_value("[1, 2]"),
        parse_value("/data/x"),
        parse_value("20GiB"),
    ) == (20, True, [1, 2], "/data/x", "20GiB")
    assert parse_override("checkpoint.interval=50") == (["checkpoint", "interval"], 50)
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_override("interval=50")


def test_write_atomic_replaces_and_syncs_the_directory(tmp_path, monkeypatch):
    import os
    import stat

    from trainguard import atomic

    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", recording_fsync)
    target = tmp_path / "state.json"
    target.write_text("old")
    atomic.write_atomic(target, "new")
    assert target.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["state.json"]
    assert synced == ["file", "dir"]

    # a temporary file elsewhere (as a checkpoint manifest does): both directories are synced
    other = tmp_path / "root"
    other.mkdir()
    synced.clear()
    atomic.write_atomic(target, b"newer", tmp=other / ".tmp-x")
    assert target.read_bytes() == b"newer" and not list(other.iterdir()) and synced == ["file", "dir", "dir"]

    # a failed write leaves the old content and no temporary file
    (tmp_path / "sub").mkdir()
    with pytest.raises(OSError):
        atomic.write_atomic(tmp_path / "sub", "x")  # a directory cannot be replaced by a file
    assert target.read_bytes() == b"newer" and sorted(os.listdir(tmp_path)) == ["root", "state.json", "sub"]
