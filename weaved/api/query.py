"""Query parameters a route does not take are refused, not dropped: FastAPI ignores them, so a client's
``?before=...`` on a list paged by ``after``, or ``?stream=true`` on a stored response, would get an
answer that silently is not the one asked for."""

from __future__ import annotations

from fastapi.dependencies.models import Dependant
from starlette.requests import Request

from weaved.errors import InvalidRequest


def _names(d: Dependant) -> set[str]:
    out = {p.alias for p in d.query_params}
    for sub in d.dependencies:
        out |= _names(sub)
    return out


async def known_query(request: Request) -> None:
    """The app's dependency on every route: a 400 naming the first query parameter the route lacks."""
    dependant = getattr(request.scope.get("route"), "dependant", None)
    if dependant is None or not request.query_params:
        return
    known = _names(dependant)
    other = sorted(set(request.query_params) - known)
    if other:
        takes = f"this route takes {', '.join(sorted(known))}" if known else "this route takes none"
        raise InvalidRequest(f"unknown query parameter {other[0]!r}: {takes}", param=other[0])
