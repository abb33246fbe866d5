"""What a PostgreSQL store's budget counts against what its disk holds (docs/TRACES.md): imports
trace folders into a fresh database, then prints the counted size (`retention.used_bytes`) beside
the tables' and indexes' size on disk, after a prune to half the budget, and after writing again.

    python scripts/measure_store_budget.py ../shared/traces/swe-agent ../shared/traces/text2sql \
        ../shared/traces/chat --again ../shared/traces/openhands

A PostgreSQL server is started in a temporary folder on 127.0.0.1 (tests/postgres_server.py).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/postgres_server.py

from agentaccel.traces import retention  # noqa: E402
from agentaccel.traces.store import TraceStore  # noqa: E402


def on_disk(store: TraceStore) -> int:
    return sum(store.conn.execute("SELECT pg_total_relation_size(?)", (table,)).fetchone()[0]
               for table in retention.SIZED_TABLES)


def import_traces(folders: list[str], url: str) -> None:
    subprocess.run(["agentaccel", "import-traces", *folders, "--db", url], check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="trace folders imported first")
    parser.add_argument("--again", nargs="*", default=[], help="trace folders imported after the prune")
    args = parser.parse_args()
    from tests.postgres_server import PostgresServer

    server = PostgresServer(Path(tempfile.mkdtemp(prefix="agentaccel-postgres-")))
    server.start()
    try:
        url = server.new_database()
        import_traces(args.folders, url)
        with TraceStore(url) as store:
            store.conn.execute("VACUUM ANALYZE")
            counted, disk = retention.used_bytes(store), on_disk(store)
            mib = 2 ** 20
            print(f"{store.total_calls():,} calls: counted {counted / mib:.1f} MiB, on disk {disk / mib:.1f} MiB "
                  f"({disk / counted:.2f} x)")
            report = retention.prune(store, retention.Retention(budget_bytes=counted // 2))
            print(f"pruned to half the count ({report.calls:,} calls went): counted "
                  f"{retention.used_bytes(store) / mib:.1f} MiB, on disk {on_disk(store) / mib:.1f} MiB")
            if args.again:
                store.conn.execute("VACUUM ANALYZE")
                import_traces(args.again, url)
                print(f"written again after a vacuum: counted {retention.used_bytes(store) / mib:.1f} MiB, "
                      f"on disk {on_disk(store) / mib:.1f} MiB")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
