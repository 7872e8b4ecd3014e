"""Every option of every subcommand says what it does and, where it has one, its default."""
import argparse
import re

from app.cli import build_parser


def subparsers():
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_every_option_has_help_and_states_its_default_once():
    missing, doubled, empty = [], [], []
    for name, sp in subparsers().items():
        fmt = sp._get_formatter()
        for a in sp._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            if not (a.help or "").strip():
                missing.append(f"{name} {a.option_strings}")
                continue
            text = fmt._expand_help(a)
            if text.count("default") > 1:
                doubled.append(f"{name} {a.option_strings}: {text}")
            if re.search(r"\(default: (None|\[\]|False|)\)", text):
                empty.append(f"{name} {a.option_strings}: {text}")
            if a.default is not None and a.default is not False and a.default not in ([], "") \
                    and "default" not in text:
                missing.append(f"{name} {a.option_strings}: default {a.default!r} not stated")
    assert not missing and not doubled and not empty, (missing, doubled, empty)


def test_train_help_shows_the_defaults_it_trains_with():
    text = subparsers()["train"].format_help()
    for option, default in (("--d-model", "192"), ("--heads", "16"), ("--lr", "0.0001"),
                            ("--variant", "continual_nystrom")):
        options = text[text.index("options:"):]
        block = options[options.index(f"  {option}"):]
        assert f"(default: {default})" in " ".join(block.split())[:400], option
