"""Prometheus text exposition of the server's stats, served by a small HTTP thread."""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

_PREFIX = "torch_kv_tier_server_"


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(stats: Mapping[str, Any]) -> str:
    """Prometheus text format (version 0.0.4) for a ``Server.stats()`` dict."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, object]]) -> None:
        lines.append(f"# HELP {_PREFIX}{name} {help_text}")
        lines.append(f"# TYPE {_PREFIX}{name} {kind}")
        lines.extend(f"{_PREFIX}{name}{labels} {value}" for labels, value in samples)

    metric("up", "gauge", "1 while the server serves.", [("", 1)])
    metric(
        "uptime_seconds",
        "gauge",
        "Seconds since the server started.",
        [("", f"{stats['uptime_s']:.3f}")],
    )
    metric("block_len_bytes", "gauge", "Bytes per block.", [("", stats["block_len"])])
    metric(
        "blocks",
        "gauge",
        "Slots of the pool by state.",
        [
            ('{state="free"}', stats["free_blocks"]),
            ('{state="leased"}', stats["leased_blocks"]),
            ('{state="shared_stored"}', stats["shared_stored_blocks"]),
            ('{state="shared_granted"}', stats["shared_granted_blocks"]),
            ('{state="held"}', stats["held_blocks"]),
        ],
    )
    metric(
        "held_sessions",
        "gauge",
        "Ended sessions whose slots are held until their client releases them.",
        [("", stats["held_sessions"])],
    )
    metric(
        "shared_evictions_total",
        "counter",
        "Keys of the shared pool evicted to make room.",
        [("", stats["shared_evictions"])],
    )
    metric(
        "commit_slots_refused_total",
        "counter",
        "Slots shared sessions committed without holding their grant: ignored (a client bug).",
        [("", stats["commit_slots_refused"])],
    )
    metric(
        "slots_used",
        "gauge",
        "Leased slots holding data, as reported by clients.",
        [("", stats["slots_used"])],
    )
    metric(
        "sessions",
        "gauge",
        "Sessions open: private leases and shared joins.",
        [("", len(stats["sessions"]))],
    )
    metric(
        "session_lease_blocks",
        "gauge",
        "Slots leased to each session.",
        [
            (
                f'{{session="{_label(s["public_id"])}",client="{_label(s["client_name"])}"}}',
                s["lease"][1] - s["lease"][0],
            )
            for s in stats["sessions"]
        ],
    )
    metric(
        "handshakes_total",
        "counter",
        "Handshakes by result.",
        [
            ('{result="accepted"}', stats["handshakes_accepted"]),
            ('{result="rejected"}', stats["handshakes_rejected"]),
        ],
    )
    metric(
        "leases_reclaimed_total",
        "counter",
        "Leases reclaimed after missed heartbeats.",
        [("", stats["leases_reclaimed"])],
    )
    metric(
        "bad_frames_total",
        "counter",
        "Control frames dropped or answered with an error.",
        [("", stats["bad_frames"])],
    )
    metric(
        "bytes_total",
        "counter",
        "Bytes moved to (written) and from (read) the pool.",
        [
            ('{direction="written"}', stats["bytes_written"]),
            ('{direction="read"}', stats["bytes_read"]),
        ],
    )
    if "disk_keys" in stats:  # a disk tier (``serve --disk``)
        _disk_metrics(stats, metric)
    return "\n".join(lines) + "\n"


def _disk_metrics(stats: Mapping[str, Any], metric: Callable[..., None]) -> None:
    metric("disk_keys", "gauge", "Keys held on the disk tier.", [("", stats["disk_keys"])])
    metric(
        "disk_bytes",
        "gauge",
        "Bytes of blocks on the disk tier, and its capacity.",
        [
            ('{kind="stored"}', stats["disk_bytes"]),
            ('{kind="capacity"}', stats["disk_capacity_bytes"]),
        ],
    )
    metric(
        "disk_blocks_total",
        "counter",
        "Blocks written to (copies ahead of eviction) and read from (promotions) the disk.",
        [('{op="written"}', stats["disk_writes"]), ('{op="read"}', stats["disk_reads"])],
    )
    metric(
        "disk_promotions_total",
        "counter",
        "Promotions from disk into DRAM (disk hits) by result.",
        [
            ('{result="done"}', stats["disk_promotions"]),
            ('{result="failed"}', stats["disk_promotions_failed"]),
            ('{result="no_slot"}', stats["disk_promotions_without_slot"]),
        ],
    )
    metric(
        "disk_evictions_total",
        "counter",
        "Keys the disk's LRU dropped.",
        [("", stats["disk_evictions"])],
    )
    metric(
        "disk_failures_total",
        "counter",
        "Blocks of failed disk I/O.",
        [("", stats["disk_failures"])],
    )
    metric(
        "disk_stuck_total",
        "counter",
        "Disk requests given up after their timeout (a hung device).",
        [("", stats["disk_stuck"])],
    )
    metric(
        "disk_stuck_in_flight",
        "gauge",
        "Disk requests given up that have not ended yet (their slots stay out of use).",
        [("", stats["disk_stuck_in_flight"])],
    )
    metric(
        "disk_writes_failing",
        "gauge",
        "--disk directories whose last write failed (full, read-only, EIO): each loses no key "
        "for writes and takes one probe a second until a write there is done; the others take "
        "the copies.",
        [("", stats["disk_writes_failing"])],
    )
    metric(
        "disk_gbps",
        "gauge",
        "Disk GB/s over the time its requests were in flight.",
        [
            ('{op="write"}', f"{stats['disk_write_gbps']:.3f}"),
            ('{op="read"}', f"{stats['disk_read_gbps']:.3f}"),
        ],
    )


class MetricsServer:
    """``GET /metrics`` on ``host:port`` (0: any free port) in a daemon thread.

    Each connection is served on a daemon thread of its own: a peer that connects and sends
    nothing (a TCP health check, a port scan) or trickles its request holds only its own thread,
    never the scrapes of others. ``render`` is called on those threads; it must be thread-safe.
    Raises ``OSError`` naming the address when the port cannot be bound.
    """

    def __init__(self, host: str, port: int, render: Callable[[], str]) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 5.0  # a stalled scraper cannot hold the (single) HTTP thread longer

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                logger.debug("metrics %s: " + format, self.client_address[0], *args)

        try:
            self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:  # the control port's error names its address: so does this
            raise OSError(
                f"cannot serve metrics on {host}:{port} (--metrics-port): {exc.strerror or exc}"
            ) from None
        self._httpd.daemon_threads = True  # ``close`` waits for none of them
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            daemon=True,
            name="tkvt-metrics",
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port (waits at most a few seconds)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)
