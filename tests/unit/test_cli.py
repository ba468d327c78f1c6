import pytest

from baige_ray.cli import build_parser, main


def test_every_subcommand_registers():
    parser = build_parser()
    args = parser.parse_args(["fit", "--workers", "4", "--steps", "3"])
    assert args.command == "fit" and args.workers == 4 and callable(args.func)


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "fit" in capsys.readouterr().out


def test_bad_config_value_is_reported_not_raised(capsys):
    assert main(["fit", "--workers", "0", "--steps", "1"]) == 2
    assert "ScalingConfig.num_workers=0" in capsys.readouterr().err
