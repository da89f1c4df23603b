"""``zmq-rollout top``: the fleet at a glance, from ``status()`` and the ``/metrics`` endpoints.

Reading and drawing are apart. ``run_top`` asks the broker for its status and reads the
metrics endpoints it is given (``zmq_rollout.scrape``); ``render`` is a pure function of
what was read (a ``StatusReply``, this ``Metrics`` sample and the previous one, for rates)
to a rich renderable, so tests draw it from made-up data with no socket. On a terminal the
view is a ``rich.live.Live`` refreshed until Ctrl-C; otherwise one plain table.

Metric families are looked up by the names below, and a missing one shows as ``-``: a broker
or an engine that exports fewer (or other) families never breaks the view.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from zmq_rollout import protocol as p
from zmq_rollout.scrape import Scrape, fetch_metrics, histogram_mean, rate

if TYPE_CHECKING:
    from zmq_rollout.blocking import RolloutClient
    from zmq_rollout.config import ClientConfig

# The broker's families (docs/metrics.md); per worker, labelled ``worker``.
JOBS = "zmq_rollout_jobs_total"
FLEET_VERSION = "zmq_rollout_fleet_weight_version"
SYNC_ROUNDS = "zmq_rollout_sync_rounds_total"
SYNC_RUNNING = "zmq_rollout_sync_rounds_in_progress"
SYNC_DURATION = "zmq_rollout_sync_round_duration_seconds"
STALENESS = "zmq_rollout_sample_staleness_versions"
WORKER_CREDITS_USED = ("zmq_rollout_worker_credits_used",)
WORKER_JOBS = ("zmq_rollout_worker_completed_jobs_total",)
# The engines' (vLLM's, and the worker's own); where a tuple has several, the first present wins.
TOKENS = ("vllm:generation_tokens_total", "zmq_rollout_worker_generated_tokens_total")
KV_USE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
"""A fraction (0..1), whatever ``_perc`` says; an endpoint with several engines shows the fullest."""
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
WORKER_LABELS = ("worker", "worker_name")
"""Labels that name a worker: a sample carrying one is that worker's, in whichever endpoint it is."""

NONE = "-"


@dataclass(frozen=True)
class Metrics:
    """One sample of every endpoint ``top`` reads (None or empty: not asked for)."""

    broker: Scrape | None = None
    workers: tuple[Scrape, ...] = ()

    def worker(self, url: str) -> Scrape | None:
        return next((s for s in self.workers if s.url == url), None)

    @property
    def at(self) -> float:
        """When the earliest of its reads was made."""
        return min((s.at for s in (self.broker, *self.workers) if s is not None), default=time.monotonic())


def _pairs(metrics: Metrics | None, previous: Metrics | None) -> list[tuple[Scrape, Scrape | None]]:
    """Each good read of ``metrics`` with the read of the same endpoint in ``previous``."""
    if metrics is None:
        return []
    pairs: list[tuple[Scrape, Scrape | None]] = []
    if metrics.broker is not None:
        pairs.append((metrics.broker, previous.broker if previous else None))
    pairs += [(s, previous.worker(s.url) if previous else None) for s in metrics.workers]
    return [(now, before) for now, before in pairs if not now.error]


def worker_metric(
    metrics: Metrics | None, previous: Metrics | None, name: str, families: Sequence[str], *, per_s: bool = False
) -> float | None:
    """Worker ``name``'s value of the first of ``families`` (its rate, ``per_s``) in any endpoint
    that labels samples with its name (``WORKER_LABELS``)."""
    for now, before in _pairs(metrics, previous):
        label = now.label_values(WORKER_LABELS).get(name)
        if label is None:
            continue
        value = rate(now, before, families, **{label: name}) if per_s else now.first(families, **{label: name})
        if value is not None:
            return value
    return None


# -- drawing ------------------------------------------------------------------------------
def _num(value: float | None, fmt: str = "{:,.1f}") -> str:
    return NONE if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return NONE if value is None else f"{100 * value:.0f}%"


def _table(title: str, columns: Iterable[tuple[str, str]], style: box.Box | None) -> Table:
    table = Table(title=title, title_justify="left", box=style, show_edge=False, pad_edge=False, expand=False)
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    return table


def render(
    status: p.StatusReply,
    metrics: Metrics | None = None,
    previous: Metrics | None = None,
    *,
    title: str = "",
    problem: str = "",
    plain: bool = False,
) -> RenderableType:
    """The view: a summary line, workers, client queues, jobs and sync, one row per engine endpoint.

    ``previous`` is the sample before ``metrics``, for rates (jobs/s, tokens/s); without it
    they show ``-``. ``problem`` is a line to show in red (a broker that stopped answering).
    ``plain`` draws without box lines, for output that is not a terminal.
    """
    style = None if plain else box.SIMPLE_HEAD
    broker = metrics.broker if metrics and metrics.broker and not metrics.broker.error else None
    before = previous.broker if previous else None
    fleet = broker.first((FLEET_VERSION,)) if broker else None
    fleet_version = int(fleet) if fleet is not None else status.fleet_version
    head = Text(f"broker {title}: " if title else "", style="bold")
    head.append(
        f"{len(status.workers)} workers, {status.queued} queued, {status.running} running, "
        f"jobs/s {_num(rate(broker, before, JOBS, outcome='completed'))}, fleet version {fleet_version}"
    )
    parts: list[RenderableType] = [head]
    if problem:
        parts.append(Text(problem, style="bold red"))
    t = status.totals
    parts += [
        _workers_table(status.workers, metrics, previous, style),
        _clients_table(status.clients, style),
        Text(
            f"jobs since start: {t.submitted} submitted, {t.completed} completed, {t.failed} failed, "
            f"{t.cancelled} cancelled, {t.requeued} requeued"
        ),
        Text("sync: " + ", ".join(sync_summary(broker, before, fleet_version))),
    ]
    if metrics and metrics.workers:
        parts.append(_engines_table(metrics, previous, style))
    unread = [s for s in ((metrics.broker, *metrics.workers) if metrics else ()) if s is not None and s.error]
    parts.extend(Text(f"{s.url}: {s.error}", style="red") for s in unread)
    return Group(*parts)


_STATE_STYLE = {"ready": "green", "syncing": "yellow", "stale": "red"}


def _workers_table(
    workers: list[p.WorkerStatus], metrics: Metrics | None, previous: Metrics | None, style: box.Box | None
) -> Table:
    table = _table(
        "workers",
        [("WORKER", "left"), ("STATE", "left"), ("VERSION", "right"), ("CREDITS", "right"), ("RUNNING", "right"),
         ("JOBS/S", "right"), ("TOK/S", "right"), ("KV", "right"), ("IDLE_S", "right"), ("MODEL", "left")],
        style,
    )  # fmt: skip
    for w in sorted(workers, key=lambda w: w.name):
        used = worker_metric(metrics, None, w.name, WORKER_CREDITS_USED)
        table.add_row(
            w.name,
            Text(w.state, style=_STATE_STYLE.get(w.state, "")),
            str(w.weight_version),
            f"{used:.0f}/{w.credits}" if used is not None else str(w.credits),
            str(w.running),
            _num(worker_metric(metrics, previous, w.name, WORKER_JOBS, per_s=True)),
            _num(worker_metric(metrics, previous, w.name, TOKENS, per_s=True)),
            _pct(worker_metric(metrics, None, w.name, KV_USE)),
            f"{w.idle_s:.1f}",
            w.model,
        )
    return table


def _clients_table(clients: list[p.ClientStatus], style: box.Box | None) -> Table:
    table = _table("client queues", [("CLIENT", "left"), ("QUEUED", "right"), ("RUNNING", "right")], style)
    for c in sorted(clients, key=lambda c: c.name):
        table.add_row(c.name, str(c.queued), str(c.running))
    return table


def _engines_table(metrics: Metrics, previous: Metrics | None, style: box.Box | None) -> Table:
    """One row per worker endpoint (``--worker-metrics``): the engine's own view of itself."""
    table = _table(
        "engines",
        [("ENDPOINT", "left"), ("WORKER", "left"), ("TOK/S", "right"), ("KV", "right"), ("RUNNING", "right"),
         ("WAITING", "right")],
        style,
    )  # fmt: skip
    for scrape in metrics.workers:
        if scrape.error:
            table.add_row(scrape.url, Text("error (below)", style="red"), NONE, NONE, NONE, NONE)
            continue
        table.add_row(
            scrape.url,
            ", ".join(sorted(scrape.label_values(WORKER_LABELS))) or NONE,
            _num(rate(scrape, previous.worker(scrape.url) if previous else None, TOKENS)),
            _pct(scrape.first(KV_USE)),
            _num(scrape.total(REQUESTS_RUNNING), "{:.0f}"),
            _num(scrape.total(REQUESTS_WAITING), "{:.0f}"),
        )
    return table


def sync_summary(broker: Scrape | None, before: Scrape | None, fleet_version: int) -> list[str]:
    """The fleet version, weight-sync rounds by outcome, which ended since ``before``, how long
    they take, and how stale the completed samples are (each part only where its family is)."""
    parts = [f"fleet version {fleet_version}"]
    if broker is None:
        return [*parts, "rounds " + NONE]
    running = broker.total(SYNC_RUNNING)
    if running is not None:
        parts.append("a round running" if running else "no round running")
    if SYNC_ROUNDS in broker.samples:
        rounds = broker.by_label(SYNC_ROUNDS, "outcome")
        parts.append("rounds " + (" ".join(f"{v:.0f} {k}" for k, v in sorted(rounds.items()) if v) or "0"))
        earlier = before.by_label(SYNC_ROUNDS, "outcome") if before and not before.error else None
        new = {k: v - earlier.get(k, 0.0) for k, v in rounds.items() if v > earlier.get(k, 0.0)} if earlier else {}
        if new:
            parts.append("just ended " + " ".join(f"{v:.0f} {k}" for k, v in sorted(new.items())))
    else:
        parts.append("rounds " + NONE)
    recent = histogram_mean(broker, SYNC_DURATION, before) if before is not None else None
    mean = histogram_mean(broker, SYNC_DURATION)
    if recent is not None:
        parts.append(f"last took {recent:.2f} s")
    if mean is not None:
        parts.append(f"mean {mean:.2f} s")
    staleness = histogram_mean(broker, STALENESS)
    if staleness is not None:
        parts.append(f"sample staleness mean {staleness:.2f} versions")
    return parts


# -- reading and looping ------------------------------------------------------------------
def read_metrics(broker_url: str, worker_urls: Sequence[str], timeout_s: float) -> Metrics:
    """Every endpoint at once (one slow endpoint costs its own timeout, not the sum)."""
    urls = ([broker_url] if broker_url else []) + list(worker_urls)
    if not urls:
        return Metrics()
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        scrapes = list(pool.map(lambda url: fetch_metrics(url, timeout_s), urls))
    return Metrics(scrapes[0] if broker_url else None, tuple(scrapes[1:] if broker_url else scrapes))


def own_status(client: RolloutClient) -> p.StatusReply:
    """``status()`` without this command's own connection among the clients."""
    st = client.status()
    st.clients = [c for c in st.clients if c.name != client.identity]
    return st


def run_top(
    config: ClientConfig,
    *,
    interval_s: float,
    metrics_url: str = "",
    worker_metrics: Sequence[str] = (),
    once: bool | None = None,
    console: Console | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Show the view: refreshed every ``interval_s`` until Ctrl-C on a terminal, or once
    (``once``, or stdout not a terminal). Raises the client's errors (a broker that does not
    answer) before drawing anything; afterwards a failed refresh is shown, not raised.
    ``sleep`` waits between samples (tests pass their own)."""
    from zmq_rollout.blocking import RolloutClient

    console = console or Console()
    if once is None:
        once = not console.is_terminal
    timeout_s = min(config.request_timeout_s, max(interval_s, 1.0))

    def read() -> Metrics | None:
        return read_metrics(metrics_url, worker_metrics, timeout_s) if metrics_url or worker_metrics else None

    with RolloutClient(config=config) as client:
        if not once:
            with contextlib.suppress(KeyboardInterrupt):
                _live(client, console, read, lambda: sleep(interval_s), config.address)
            return
        status = own_status(client)  # a broker that does not answer fails here, before any wait
        # Rates need two samples: the one-shot view reads the metrics twice, interval_s apart,
        # and the status again with the second (so totals and rates are of one moment).
        first = read()
        if first is not None:
            sleep(max(0.0, interval_s - (time.monotonic() - first.at)))
            status = own_status(client)
        view = render(status, read(), first, title=config.address, plain=not console.is_terminal)
        if console.is_terminal:
            console.print(view)
        else:
            console.file.write(plain_text(view) + "\n")


def plain_text(view: RenderableType, width: int = 200) -> str:
    """``view`` as plain text, wide enough that nothing is cut (a pipe or a file has no width)."""
    console = Console(file=io.StringIO(), width=width, no_color=True, highlight=False, color_system=None)
    with console.capture() as captured:
        console.print(view)
    return "\n".join(line.rstrip() for line in captured.get().splitlines())


def _live(
    client: RolloutClient, console: Console, read: Callable[[], Metrics | None], pause: Callable[[], None], title: str
) -> None:
    from rich.live import Live

    from zmq_rollout.errors import RolloutError

    status, metrics = own_status(client), read()
    with Live(render(status, metrics, title=title), console=console, auto_refresh=False) as live:
        while True:
            pause()
            problem = ""
            try:
                status = own_status(client)
            except RolloutError as exc:  # keep the last view; the client reconnects by itself
                problem = f"broker not answering: {exc}"
            previous, metrics = metrics, read()
            live.update(render(status, metrics, previous, title=title, problem=problem), refresh=True)
