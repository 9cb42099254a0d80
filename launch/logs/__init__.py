"""`launch logs`: read a run's JSON-lines log (the file the ready line names).

events.py, timeline.py and summary.py are the pure core (records in, data out); read.py reads
files (and follows a live one); show.py draws with rich; command.py is the CLI; files.py names,
prunes and rotates the run files the launcher writes.
"""


def main(argv: list[str] | None = None) -> int:
    import os
    import sys

    from launch.logs.command import main as run

    try:
        return run(argv)
    except BrokenPipeError:  # `launch logs FILE --list | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
