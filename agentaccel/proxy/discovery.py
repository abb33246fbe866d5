"""Stage discovery in the proxy: an untagged request's stage is the prompt template it matches
(traces/template_miner.py). Templates the miner establishes are saved to the trace store (in a
thread, off the event loop) and read back at start, so a stage keeps its name across restarts.

With tenants kept apart (`scoped`), each tenant's prompts go to a miner of its own: which templates
exist, and under which names, is learned from that tenant's calls alone (a name comes from a
template's text, and a first call matched at once would tell that another tenant sent the same
template). Every tenant's miner starts from the base's templates (the store's: imported, or found
on servers without keys); a tenant's own are kept in memory and found again after a restart."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from agentaccel.traces import template_stages, templates
from agentaccel.traces.database import Location
from agentaccel.traces.store import TraceStore
from agentaccel.traces.template_miner import MinerConfig, TemplateMiner, template_text

log = logging.getLogger("agentaccel.proxy")


class StageDiscovery:
    """Used from the event loop only (the miner is not thread-safe); the store is written in a thread."""

    def __init__(self, location: Location | None, save: bool, config: MinerConfig | None = None,
                 scoped: bool = False) -> None:
        self.miner = TemplateMiner(config)  # the base's: calls without a tenant, or every call unless scoped
        self.scoped = scoped
        self._tenant_miners: dict[str, TemplateMiner] = {}
        self._base_templates: list[tuple[str, list[str], int]] = []  # as loaded: where a tenant's miner starts
        self.location = location  # read at start (names kept from earlier runs)...
        self.save_to_store = save and location is not None  # ...and written while serving (when recording)
        self.found = 0  # requests given a discovered stage
        self.unmatched = 0  # requests with a prompt but no established template (first calls, one-offs)
        self.save_errors = 0
        self._saving: asyncio.Task | None = None
        self._store: TraceStore | None = None  # opened at the first save, kept (saves run one at a time)
        self.stages: dict[str, str] = {}  # template -> the stage its imported calls carry (traces/template_stages.py)

    def load(self) -> None:
        """The templates the store kept (blocking: called before serving starts)."""
        if self.location is None:
            return
        try:
            with TraceStore(self.location) as store:
                saved = templates.read(store)
                # templates whose calls were imported under a stage of their own: served as that stage
                self.stages = template_stages.read(store)
        except Exception as e:  # noqa: BLE001 - a store that cannot be read costs the kept names, not the server
            log.warning("stage discovery: no templates read from the trace store (%r); stages are found anew", e)
            return
        self._base_templates = [(t.stage, t.fixed, t.calls) for t in saved]
        self.miner.restore(self._base_templates)
        self.miner.reserve({t.stage: t.fixed for t in saved})  # those past the cap keep their names too

    def _miner(self, tenant: str | None) -> TemplateMiner:
        if not self.scoped or tenant is None:
            return self.miner
        miner = self._tenant_miners.get(tenant)
        if miner is None:
            miner = self._tenant_miners[tenant] = TemplateMiner(self.miner.config)
            miner.restore(self._base_templates)
        return miner

    def stage(self, body: Mapping, tenant: str | None = None) -> str | None:
        """The discovered stage of a request (of `tenant`), or None (not a template yet, or over the cap)."""
        miner = self._miner(tenant)
        messages = body.get("messages")
        if isinstance(messages, list):
            text = template_text(messages, miner.config.max_chars)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            return None
        match = miner.observe(text)
        if match.stage is None:
            self.unmatched += match.template is not None
            return None
        self.found += 1
        saved = miner is self.miner and self.save_to_store  # a tenant's templates stay in memory
        if saved and self.miner.changed and (self._saving is None or self._saving.done()):
            self._saving = asyncio.get_running_loop().create_task(self.save())
        return self.stages.get(match.stage, match.stage)

    async def save(self) -> None:
        changed, renamed = self.miner.take_changes()
        retired = self.miner.take_retired()
        if not changed and not renamed and not retired:
            return
        rows = [templates.SavedTemplate.of(t) for t in changed]
        try:
            stored = await asyncio.to_thread(self._write, rows, renamed, retired)
        except Exception as e:  # noqa: BLE001 - a store that cannot be written costs names, never a request
            self.save_errors += 1
            log.warning("stage discovery: templates not saved to the trace store: %r", e)
            self.miner.changed.update(t.stage for t in rows)  # tried again with the next change
            self.miner.renamed[:0] = renamed
            self.miner.retired[:0] = retired
            return
        # Names other servers' templates hold (in the store first): ours gives way and is named anew.
        lost = self.miner.reserve(stored)
        if lost:
            log.warning("stage discovery: another server's template holds %s in the trace store; this server's "
                        "template of that name is renamed", ", ".join(lost))

    def _write(self, rows: list[templates.SavedTemplate], renamed: list[tuple[str, str]],
               retired: list[str]) -> dict[str, list[str]]:
        """Writes, then reads back every kept template (the fleet's names: stage -> fixed lines)."""
        if self._store is None:
            self._store = TraceStore(self.location)
        try:
            templates.write(self._store, rows, renamed, retired)
            return {t.stage: t.fixed for t in templates.read(self._store)}
        except Exception:
            self._close_store()  # a connection that failed is opened anew for the next save
            raise

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    async def close(self) -> None:
        """Saves what changed, with every template's latest call count."""
        if not self.save_to_store:
            return
        if self._saving is not None:
            await self._saving
        self.miner.changed.update(self.miner.named)
        await self.save()
        await asyncio.to_thread(self._close_store)

    def metrics(self) -> dict[str, float]:
        miners = [self.miner, *self._tenant_miners.values()]
        return {"stages": sum(len(m.named) for m in miners), "pending": sum(len(m.new) for m in miners),
                "found": self.found, "unmatched": self.unmatched, "overflow": sum(m.overflow for m in miners),
                "save_errors": self.save_errors}
