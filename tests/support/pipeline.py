"""What tests observe behind the handlers' narrow interface: the one model's pipeline
(``LocalPipeline``) and the admission actor it wraps (its queue, its active requests, its
drain)."""

from __future__ import annotations

from typing import cast

from mlxcel.actors.admission import Admission
from mlxcel.actors.pipeline import LocalPipeline
from mlxcel.http.context import ServerContext


def pipeline(ctx: ServerContext) -> LocalPipeline:
    model = ctx.models.default()
    assert model is not None, "no model loaded"
    return cast(LocalPipeline, model.pipeline)


def admission(ctx: ServerContext) -> Admission:
    return pipeline(ctx).admission
