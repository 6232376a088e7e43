//! Snapshot measurements: full snapshots of the idle guest and of a guest
//! rewriting memory meanwhile (pre-copied: the guest-stopped time and the
//! time to durable apart), incremental snapshots of N dirtied pages, and
//! the 1,000-page incremental snapshot again under a busy disk (a
//! background writer with `fdatasync` on the snapshots' filesystem).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use twig_store::NodeStore;
use twig_vmm::testguest::{self, Command};
use twig_vmm::Kind;

use super::{dirty, median, Guest, PAGE_COUNTS, T};
use crate::stats::{Context, Error, Report};

/// Pages of the incremental snapshot measured under a busy disk.
const BUSY_PAGES: u64 = 1000;
/// The busy writer cycles over a file of this size.
const BUSY_FILE: u64 = 256 << 20;
/// It writes this much between two `fdatasync`s.
const BUSY_BATCH: usize = 4 << 20;

/// Measures full and incremental snapshots of `g` into `store` (`runs`
/// each), the incremental ones also under a busy disk writing into
/// `busy_dir`; returns the id of the last full snapshot, which the VM is
/// rolled back to and which the later measurements use. `value` is the
/// running value the guest writes into dirtied pages.
pub(super) fn measure(
    r: &mut Report,
    runs: usize,
    g: &mut Guest,
    store: &NodeStore,
    busy_dir: &Path,
    value: &mut u64,
) -> Result<String, Error> {
    // Full snapshots of the idle guest, staged and published in the node
    // store (both timed); the last one is the base of the rest.
    let (full, base) = full_runs(g, store, runs, "full")?;
    full.report(r, "snapshot_full");
    let base_id = base.ok_or("no full snapshot was taken")?;
    let base = store.snapshot_dir(&base_id);

    // Incremental snapshots of N dirtied pages on top of the base (the VM
    // is rolled back to it, untimed, before each), so that the previous one
    // has no child and the store can delete it.
    let mut inc = Incremental {
        g,
        store,
        base: &base,
        last: None,
        value,
    };
    let mut written = Map::new();
    for n in PAGE_COUNTS {
        let m = inc.runs(n, runs)?;
        r.timing(&format!("snapshot_incr_{n}_ms"), &m.samples);
        r.timing(&format!("snapshot_incr_{n}_pause_ms"), &m.pauses);
        written.insert(n.to_string(), json!(median(m.pages)));
    }
    r.value("snapshot_incr_pages_written_p50", Value::Object(written));

    // The same under a busy disk.
    let busy = BusyDisk::start(busy_dir)?;
    let m = inc.runs(BUSY_PAGES, runs);
    let (bytes, took) = busy.stop()?;
    let m = m?;
    r.timing(&format!("snapshot_incr_{BUSY_PAGES}_busy_ms"), &m.samples);
    r.timing(
        &format!("snapshot_incr_{BUSY_PAGES}_busy_pause_ms"),
        &m.pauses,
    );
    r.value(
        "busy_disk_write_mib_s",
        json!((bytes as f64 / (1 << 20) as f64 / took.as_secs_f64()).round()),
    );

    if let Some(old) = inc.last.take() {
        store.delete(&old).context(|| format!("deleting {old}"))?;
    }

    // Full snapshots of a guest rewriting CHURN_PAGES pages without pause
    // (the churn command), which the pre-copy copies again in rounds.
    let want = testguest::post(
        &mut g.vm,
        Command::Churn,
        [testguest::SCRATCH, CHURN_PAGES, 0],
    )?;
    testguest::poll(T, "the churn to run two passes", || {
        Ok(g.vm.read_u64(testguest::DONE)? >= want
            && g.vm.read_u64(testguest::CHURN_VERIFIED)? >= 2 * CHURN_PAGES)
    })?;
    let churned = full_runs(g, store, runs, "full-churn");
    // Any other command stops the churn; the guest idles again.
    g.vm.write_u64(testguest::MAILBOX, 0)?;
    let (churned, last) = churned?;
    if g.vm.read_u64(testguest::CHURN_BAD)? != 0 {
        return Err("the churning guest saw a page change under it".into());
    }
    churned.report(r, "snapshot_full_churn");
    if let Some(old) = last {
        store.delete(&old).context(|| format!("deleting {old}"))?;
    }
    Ok(base_id)
}

/// Pages the churning guest rewrites during its full snapshots (4 MiB).
const CHURN_PAGES: u64 = 1000;

/// What a series of full snapshots measured.
struct Full {
    /// The call: stage, snapshot, publish.
    calls: Vec<Duration>,
    /// Until the snapshot was durable (`SnapshotInfo::duration_ms`).
    durable: Vec<Duration>,
    /// The guest stopped (`SnapshotInfo::pause_ms`).
    pauses: Vec<Duration>,
    rounds: Vec<usize>,
    paused_pages: Vec<usize>,
}

impl Full {
    fn report(&self, r: &mut Report, key: &str) {
        r.timing(&format!("{key}_ms"), &self.calls);
        r.timing(&format!("{key}_durable_ms"), &self.durable);
        r.timing(&format!("{key}_pause_ms"), &self.pauses);
        r.value(
            &format!("{key}_precopy_rounds_p50"),
            json!(median(self.rounds.clone())),
        );
        r.value(
            &format!("{key}_pages_paused_p50"),
            json!(median(self.paused_pages.clone())),
        );
    }
}

/// `runs` full snapshots of `g` into `store` as `<prefix>-<i>`, each one
/// deleting the one before; returns the measurements and the last id.
fn full_runs(
    g: &mut Guest,
    store: &NodeStore,
    runs: usize,
    prefix: &str,
) -> Result<(Full, Option<String>), Error> {
    let mut m = Full {
        calls: Vec::with_capacity(runs),
        durable: Vec::with_capacity(runs),
        pauses: Vec::with_capacity(runs),
        rounds: Vec::with_capacity(runs),
        paused_pages: Vec::with_capacity(runs),
    };
    let mut last: Option<String> = None;
    for i in 0..runs {
        let id = format!("{prefix}-{i}");
        let start = Instant::now();
        let info =
            g.vm.snapshot_into(store, &id, Kind::Full)
                .context(|| format!("{prefix} snapshot run {i}"))?;
        m.calls.push(start.elapsed());
        m.durable
            .push(Duration::from_secs_f64(info.duration_ms / 1e3));
        m.pauses.push(Duration::from_secs_f64(info.pause_ms / 1e3));
        m.rounds.push(info.precopy_rounds);
        m.paused_pages.push(info.pages_paused);
        if let Some(old) = last.replace(id) {
            store.delete(&old).context(|| format!("deleting {old}"))?;
        }
    }
    Ok((m, last))
}

/// What a series of incremental snapshots measured.
struct Measured {
    samples: Vec<Duration>,
    pauses: Vec<Duration>,
    pages: Vec<usize>,
}

/// Incremental snapshots on top of `base`.
struct Incremental<'a> {
    g: &'a mut Guest,
    store: &'a NodeStore,
    base: &'a Path,
    /// The last incremental snapshot, deleted when the next is taken.
    last: Option<String>,
    value: &'a mut u64,
}

impl Incremental<'_> {
    /// `runs` incremental snapshots of `n` dirtied pages, each after a
    /// rollback to the base (untimed).
    fn runs(&mut self, n: u64, runs: usize) -> Result<Measured, Error> {
        let mut m = Measured {
            samples: Vec::with_capacity(runs),
            pauses: Vec::with_capacity(runs),
            pages: Vec::with_capacity(runs),
        };
        for i in 0..runs {
            self.g
                .vm
                .rollback(self.base)
                .context(|| "rolling back to the base snapshot".into())?;
            *self.value += n;
            dirty(&mut self.g.vm, n, *self.value)?;
            let id = format!("incr-{n}-{i}-{}", *self.value);
            let start = Instant::now();
            let info = self
                .g
                .vm
                .snapshot_into(self.store, &id, Kind::Incremental)
                .context(|| format!("incremental snapshot of {n} pages, run {i}"))?;
            m.samples.push(start.elapsed());
            m.pauses.push(Duration::from_secs_f64(info.pause_ms / 1e3));
            if info.pages_written < n as usize {
                return Err(format!(
                    "an incremental snapshot after dirtying {n} pages wrote {}",
                    info.pages_written
                )
                .into());
            }
            m.pages.push(info.pages_written);
            if let Some(old) = self.last.replace(id) {
                self.store
                    .delete(&old)
                    .context(|| format!("deleting {old}"))?;
            }
        }
        Ok(m)
    }
}

/// A background writer keeping a filesystem busy: it writes
/// [`BUSY_BATCH`] bytes and `fdatasync`s, over and over, cycling over a
/// [`BUSY_FILE`]-byte file, until stopped. The file is removed when it
/// stops.
struct BusyDisk {
    stop: Arc<AtomicBool>,
    writer: Option<JoinHandle<std::io::Result<u64>>>,
    path: PathBuf,
    start: Instant,
}

impl BusyDisk {
    /// Starts writing into a new file in `dir`.
    fn start(dir: &Path) -> Result<BusyDisk, Error> {
        let path = dir.join("busy-disk");
        let file = File::create(&path).context(|| format!("creating {}", path.display()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let writer = std::thread::Builder::new()
            .name("busy-disk".into())
            .spawn(move || write_until(&file, &flag))
            .context(|| "starting the busy-disk writer".into())?;
        Ok(BusyDisk {
            stop,
            writer: Some(writer),
            path,
            start: Instant::now(),
        })
    }

    /// Stops the writer; returns the bytes it wrote and for how long.
    fn stop(mut self) -> Result<(u64, Duration), Error> {
        self.stop.store(true, Ordering::Relaxed);
        let took = self.start.elapsed();
        let bytes = match self.writer.take().map(JoinHandle::join) {
            Some(Ok(r)) => r.context(|| "the busy-disk writer".into())?,
            Some(Err(_)) => return Err("the busy-disk writer panicked".into()),
            None => 0,
        };
        Ok((bytes, took))
    }
}

impl Drop for BusyDisk {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        if let Err(e) = std::fs::remove_file(&self.path) {
            eprintln!("removing {}: {e}", self.path.display());
        }
    }
}

/// The busy writer's loop; returns the bytes written.
fn write_until(file: &File, stop: &AtomicBool) -> std::io::Result<u64> {
    let mut chunk = vec![0u8; 1 << 20];
    let (mut offset, mut total, mut batch) = (0u64, 0u64, 0usize);
    while !stop.load(Ordering::Relaxed) {
        // New bytes every time, so nothing is skipped as unchanged.
        chunk[..8].copy_from_slice(&total.to_le_bytes());
        file.write_all_at(&chunk, offset)?;
        offset = (offset + chunk.len() as u64) % BUSY_FILE;
        total += chunk.len() as u64;
        batch += chunk.len();
        if batch >= BUSY_BATCH {
            file.sync_data()?;
            batch = 0;
        }
    }
    Ok(total)
}
