"""Offline work on whole files and token sets: token extraction, training, evaluation and its
report, accuracy from audio, benchmarks and the terminal demo. Used by app/commands/."""
