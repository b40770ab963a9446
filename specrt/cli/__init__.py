"""specrt's command line: one module per command, each parsing its options and printing; the
work is the library's.

    specrt export | build | distill | corpus | generate | batch | serve | bench | verify
"""

from __future__ import annotations

import click

from specrt.cli.batch import batch
from specrt.cli.bench import bench
from specrt.cli.common import DEFAULTS
from specrt.cli.corpus import corpus
from specrt.cli.distill import distill
from specrt.cli.export import build, export
from specrt.cli.generate import generate
from specrt.cli.serve import serve
from specrt.cli.verify import verify

__all__ = ["DEFAULTS", "main"]


@click.group()
@click.version_option(package_name="specrt")
def main() -> None:
    """Lossless speculative decoding on ONNX Runtime."""


for command in (export, build, distill, corpus, generate, batch, serve, bench, verify):
    main.add_command(command)
