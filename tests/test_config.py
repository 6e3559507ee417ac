"""Config loading: TOML, --set overrides, clear errors naming key and file."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

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


@pytest.mark.parametrize("text,key", [
    ("[checkpoint]\ninterval = 'often'\n", "checkpoint.interval"),
    ("[checkpoint]\ninterval = -5\n", "checkpoint.interval"),
    ("[checkpoint]\nkeep_last = 0\n", "checkpoint.keep_last"),
    ("[stop]\nmax_duration = 'soon'\n", "stop.max_duration"),
    ("[preemption]\nsignals = ['SIGFOO']\n", "preemption.signals"),
])
def test_bad_values_name_key_and_file(tmp_path, text, key):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert key in str(e.value) and str(p) in str(e.value)


def test_malformed_toml_names_file(tmp_path):
    p = write(tmp_path, "[checkpoint\ninterval = 5\n")
    with pytest.raises(ConfigError, match=rf"malformed TOML in {p}"):
        load_config(p)


def test_missing_file_and_bad_set():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/train.toml")
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["interval"])


@pytest.mark.parametrize("value,seconds", [(90, 90.0), ("90s", 90.0), ("2h", 7200.0), ("1d1m", 86460.0),
                                           ("01:30:00", 5400.0), (None, None)])
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
    r = subprocess.run([sys.executable, "-m", "trainguard.cli", "run", "--run-dir", str(tmp_path / "run"),
                        "--config", str(p), str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "checkpoint.interval" in r.stderr and "should not run" not in r.stdout


def test_script_arguments_other_than_config_and_set_are_refused():
    from trainguard.config import config_from_argv

    with pytest.raises(ConfigError, match=r"unexpected arguments \['--inject', 'nan_loss:rank=1,step=5'\].*before the script name"):
        config_from_argv(Config, ["--set", "run.seed=1", "--inject", "nan_loss:rank=1,step=5"])
