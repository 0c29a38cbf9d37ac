"""Pure compute (no I/O): the fp8 e4m3 codec, absorbed MLA attention over the latent cache
(numpy; optional cupy mirror) and a reference MLA decoder."""
