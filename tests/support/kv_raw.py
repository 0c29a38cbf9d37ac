"""What a test reads of a ``.coli_kv`` file's records that the engine never does: the stored
(unsanitised) scales, where production reads only the sanitised ones
(:meth:`~sessionstore.kvfile.reader.KVReader.sanitized_scales`)."""
from __future__ import annotations

import numpy as np

from kernels.errors import FormatError
from sessionstore.kvfile.reader import KVReader


def raw_scales(kv: KVReader, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """The stored Lc/Rc scales (v3: radii) of one layer, as written: [nrec] f32 views."""
    if not 0 <= layer < kv.dims.n_layers:
        raise IndexError(f"layer {layer} outside [0, {kv.dims.n_layers})")
    if kv.version == 1:
        raise FormatError(f"{kv.path}: v{kv.version} rows carry no scales")
    part = kv.records["layers"][:, layer]  # [nrec] layer records (view)
    return part["lc_scale"], part["rc_scale"]
