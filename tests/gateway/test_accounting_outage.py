"""Zero rows lost across a real database outage (a throwaway PostgreSQL cluster that this test
starts, stops mid-load, starts again and removes; the shared server on :5432 is never touched) and
across the death of the writer's process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.accounting import AccountingWriter, RequestRecord
from gateway.db.database import make_database
from gateway.db.migrate import upgrade_async
from gateway.db.schema import daily_usage, requests


@dataclass(frozen=True)
class ThrowawayPostgres:
    bin_dir: Path
    data_dir: Path
    socket_dir: Path
    port: int
    run_as: tuple[str, ...]  # PostgreSQL refuses to run as root: as root, commands go through runuser

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    def run(self, *command: str) -> None:
        subprocess.run([*self.run_as, *command], check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 -c fsync=off -c shared_buffers=16MB"
        )
        self.run(
            str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l", str(self.data_dir / "server.log"),
            "-o", options, "-w", "-t", "60", "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self.run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def throwaway_postgres() -> Iterator[ThrowawayPostgres]:
    bin_dirs = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
    if not bin_dirs or not (bin_dirs[-1] / "initdb").exists():
        pytest.skip("needs PostgreSQL server binaries under /usr/lib/postgresql/*/bin (initdb, pg_ctl)")
    run_as: tuple[str, ...] = ()
    owner: pwd.struct_passwd | None = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root needs a `postgres` OS user to own the throwaway cluster")
        if shutil.which("runuser") is None:
            pytest.skip("running as root needs runuser to start the throwaway cluster as `postgres`")
        run_as = ("runuser", "-u", "postgres", "--")
    root = Path(tempfile.mkdtemp(prefix="sluice-pg-"))
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    cluster = ThrowawayPostgres(
        bin_dir=bin_dirs[-1], data_dir=root / "data", socket_dir=root, port=_free_port(), run_as=run_as
    )
    try:
        cluster.run(
            str(cluster.bin_dir / "initdb"), "-D", str(cluster.data_dir), "-A", "trust", "-U", "postgres",
            "-E", "UTF8", "--no-sync", "--no-instructions",
        )  # fmt: skip
        cluster.start()
        yield cluster
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            cluster.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


async def test_no_row_is_lost_when_postgres_stops_mid_load_and_comes_back(
    throwaway_postgres: ThrowawayPostgres, tmp_path: Path
) -> None:
    await upgrade_async(throwaway_postgres.url)
    engine = make_database(throwaway_postgres.url)
    writer = AccountingWriter(engine, tmp_path / "spool", batch_size=100, flush_interval_s=0.02, retry_interval_s=0.2)
    await writer.start()
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    submitted = 0
    loading = True

    async def load() -> None:
        nonlocal submitted
        while loading:
            for _ in range(20):
                request_id = f"{tenant}-{submitted}"
                writer.submit(RequestRecord(request_id=request_id, tenant=tenant, feature="f", tier="small"))
                submitted += 1
            await asyncio.sleep(0.01)

    load_task = asyncio.create_task(load())
    try:
        await asyncio.sleep(0.5)
        await asyncio.to_thread(throwaway_postgres.stop)
        submitted_before_outage_ended = submitted
        await asyncio.sleep(1.0)
        assert submitted > submitted_before_outage_ended, "requests kept being accounted while the database was down"
        assert writer.stats().database_up is False
        await asyncio.to_thread(throwaway_postgres.start)
        await asyncio.sleep(0.5)
    finally:
        loading = False
        await load_task
    await writer.close()

    async with engine.connect() as connection:
        rows = (await connection.execute(sa.select(sa.func.count()).select_from(requests))).scalar()
        counted = (await connection.execute(sa.select(sa.func.sum(daily_usage.c.requests)))).scalar()
    await engine.dispose()

    stats = writer.stats()
    print(f"submitted={submitted} {stats}")
    assert stats.spooled > 0 and stats.replayed > 0, "the outage must have gone through the spool"
    assert (rows, counted) == (submitted, submitted)
    assert stats.dropped == 0
    assert list((tmp_path / "spool").glob("*.jsonl")) == []


# Spools 200 records while the database is unreachable, then dies without close().
_DYING_WRITER = textwrap.dedent(
    """
    import asyncio, os, sys
    from gateway.accounting import AccountingWriter, RequestRecord
    from gateway.db.database import make_database

    async def main() -> None:
        spool_dir, tenant = sys.argv[1], sys.argv[2]
        writer = AccountingWriter(make_database("postgresql+asyncpg://postgres@127.0.0.1:1/x"), spool_dir)
        await writer.start()
        for n in range(200):
            writer.submit(RequestRecord(request_id=f"{tenant}-{n}", tenant=tenant, feature="f", tier="small"))
        while writer.stats().spooled < 200:
            await asyncio.sleep(0.01)
        os._exit(0)

    asyncio.run(main())
    """
)


async def test_a_new_process_replays_the_spool_a_dead_one_left(postgres_url: str, tmp_path: Path) -> None:
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    spool_dir = tmp_path / "spool"
    repository = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, "-c", _DYING_WRITER, str(spool_dir), tenant], cwd=repository, check=True, timeout=120
    )
    assert list(spool_dir.glob("*.jsonl"))

    engine = make_database(postgres_url)
    writer = AccountingWriter(engine, spool_dir)
    await writer.start()
    await writer.close()
    async with engine.connect() as connection:
        rows = (await connection.execute(sa.select(sa.func.count()).where(requests.c.tenant == tenant))).scalar()
        counted = (
            await connection.execute(
                sa.select(sa.func.sum(daily_usage.c.requests)).where(daily_usage.c.tenant == tenant)
            )
        ).scalar()
    await engine.dispose()
    assert (rows, counted) == (200, 200)
    assert list(spool_dir.glob("*.jsonl")) == []
