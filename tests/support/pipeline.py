"""What tests observe behind the handlers' narrow interface: the admission actor that
``LocalPipeline`` wraps (its queue, its active requests, its drain)."""

from __future__ import annotations

from typing import cast

from mlxcel.actors.admission import Admission
from mlxcel.actors.pipeline import LocalPipeline
from mlxcel.http.context import ServerContext


def admission(ctx: ServerContext) -> Admission:
    return cast(LocalPipeline, ctx.pipeline).admission
