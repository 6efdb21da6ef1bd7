"""Curation filters as plug-ins: one module per rule family, one registry.

A filter is a `data_prep.filters.base.CurationFilter` subclass: its section `curate.<name>` (a
`FilterBase` model: enabled, skip_domains, its thresholds), the fields that change its
statistics, and `failures(stats, cfg)`, the rules a document fails. `curate/heuristics` computes
the statistics; `curate/select` applies the rules, keeps every removed record with its reasons,
and counts them. Both steps' reads come from this registry: neither keeps a list of filters.

The built-ins live beside this file (length, encoding, gopher_quality, gopher_repetition, c4,
fineweb: datatrove's families, data_prep/heuristics.py; toxicity: a classifier's score). Another
package adds one without editing lmforge through the `lmforge.curation_filters` entry-point group:

    [project.entry-points."lmforge.curation_filters"]
    boilerplate = "my_package.boilerplate:Boilerplate"
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from data_prep.filters.base import CurationFilter

GROUP = "lmforge.curation_filters"
BUILTIN = (
    "data_prep.filters.length:Length",
    "data_prep.filters.encoding:Encoding",
    "data_prep.filters.gopher_quality:GopherQuality",
    "data_prep.filters.gopher_repetition:GopherRepetition",
    "data_prep.filters.c4:C4",
    "data_prep.filters.fineweb:FineWeb",
    "data_prep.filters.toxicity:Toxicity",
)


@functools.cache
def filters() -> dict[str, CurationFilter]:
    """Every registered filter by name, in reporting order: the built-ins, then entry points by name."""
    from lmforge.plugins import registered

    return registered(BUILTIN, GROUP, "curation filter")
