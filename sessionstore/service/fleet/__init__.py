"""The fleet room: this server as one host of a fleet sharing an object store, and sessions moving
between servers as bundles over HTTP.

- :mod:`~sessionstore.service.fleet.home`: :class:`FleetHome`, the engine core's check-out and
  check-in of a session's lease (FORMAT.md 6.4, 7);
- :mod:`~sessionstore.service.fleet.proxy`: ``--fleet-proxy``, a request forwarded to the host
  holding its session;
- :mod:`~sessionstore.service.fleet.bundle_export`, ``bundle_upload``, ``bundle_pull``: a session's
  bundle streamed out (``GET .../bundle``), in (``PUT .../bundle``) and fetched from a peer
  (``POST .../pull``), in the API process; the engine core installs what was received.

Imports the service's floor (``errors``, ``bind``) and the rooms below the service; nothing of the
engine core or of ``http``. The surface imports no optional extra: ``proxy``, ``bundle_upload`` and
``bundle_pull`` need the ``service`` extra and are imported by their own names where they are used.
"""
from sessionstore.service.fleet.bundle_export import export_compression, export_stream
from sessionstore.service.fleet.home import FleetHome

__all__ = ["FleetHome", "export_compression", "export_stream"]
