//! Benchmarks of twig-snapshotter: Prepare of a child of a committed parent
//! (reflink) against a full copy of the parent's image, 100 concurrent
//! Prepares from one parent, and the disk space 100 children really take.
//!
//! Runs on a loop-mounted XFS (`mkfs.xfs -m reflink=1`) it creates and
//! removes itself (needs root), or on `--dir`, an existing directory on a
//! reflink-capable filesystem.

use crate::loop_xfs::{exec, LoopXfs};
use crate::stats::{row, Error, Summary};
use serde_json::json;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use twig_snapshotter::{SnapshotStore, StoreOptions};
use twig_store::fsops;

#[derive(clap::Args)]
pub struct Args {
    /// Size of the committed parent's data, in MiB.
    #[arg(long, default_value_t = 1024)]
    parent_mib: u64,
    /// Number of concurrent Prepares from the parent.
    #[arg(long, default_value_t = 100)]
    children: usize,
    /// Repetitions of the single reflink-Prepare timing.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// Repetitions of the full-copy timing (each copies the whole parent).
    #[arg(long, default_value_t = 5)]
    copy_runs: usize,
    /// Use this directory (on XFS with reflink, or btrfs) instead of a
    /// loop-mounted XFS made for the run.
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// Removes the benchmark's store directory, also when the run fails.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.0) {
            if e.kind() != std::io::ErrorKind::NotFound {
                eprintln!("twig-bench: cannot remove {}: {e}", self.0.display());
            }
        }
    }
}

/// Bytes in use on the filesystem holding `path`, after a syncfs (which also
/// lets XFS finish freeing blocks of deleted files in the background).
fn fs_used(path: &Path) -> Result<u64, Error> {
    settle(path)?;
    let out = exec(
        Command::new("stat")
            .args(["-f", "-c", "%S %b %f"])
            .arg(path),
    )?;
    let v: Vec<u64> = out
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    match v.as_slice() {
        [bsize, blocks, free] => Ok(bsize * (blocks - free)),
        _ => Err(format!("unexpected `stat -f` output {out:?}").into()),
    }
}

/// syncfs on the filesystem of `path`: timings start from a quiet filesystem.
fn settle(path: &Path) -> Result<(), Error> {
    exec(Command::new("sync").arg("-f").arg(path)).map(|_| ())
}

/// Mounts a snapshot's mounts with mount(8), runs `f` on the mount point,
/// unmounts.
fn with_mounted(
    mounts: &[twig_snapshotter::Mount],
    at: &Path,
    f: impl FnOnce(&Path) -> Result<(), Error>,
) -> Result<(), Error> {
    let m = mounts.first().ok_or("snapshot without mounts")?;
    fs::create_dir_all(at)?;
    exec(
        Command::new("mount")
            .args(["-t", &m.fstype, "-o", &m.options.join(",")])
            .arg(&m.source)
            .arg(at),
    )?;
    let result = f(at);
    let unmounted = exec(Command::new("umount").arg(at));
    result.and(unmounted.map(|_| ()))
}

const MIB: f64 = 1048576.0;

pub fn run(args: &Args) -> Result<serde_json::Value, Error> {
    if args.runs == 0 || args.copy_runs == 0 || args.children == 0 || args.parent_mib == 0 {
        return Err("--runs, --copy-runs, --children and --parent-mib must be positive".into());
    }
    let image_mib = args.parent_mib + args.parent_mib / 4 + 64;
    let loop_xfs;
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => {
            // Parent + one full copy at a time + headroom.
            let base =
                std::env::temp_dir().join(format!("twig-bench-snapshotter-{}", std::process::id()));
            loop_xfs = LoopXfs::new(&base, image_mib * 2 + args.parent_mib / 2 + 512)?;
            loop_xfs.mnt().to_path_buf()
        }
    };
    let root = dir.join("twig-bench-store");
    if root.exists() {
        return Err(format!(
            "{} already exists; the benchmark needs to create it fresh (and removes it after)",
            root.display()
        )
        .into());
    }
    let _cleanup = RemoveOnDrop(root.clone());
    let store = SnapshotStore::open(
        &root,
        &StoreOptions {
            image_size: image_mib << 20,
            allow_copy: false,
        },
    )?;

    // The committed parent: an ext4 image holding parent_mib of file data.
    eprintln!(
        "twig-bench snapshotter: writing a {} MiB parent …",
        args.parent_mib
    );
    let mounts = store.prepare("parent-active", None, Default::default())?;
    with_mounted(&mounts, &root.join("mnt-parent"), |m| {
        let mut f = fs::File::create(m.join("data"))?;
        let mut chunk = vec![0u8; 1 << 20];
        for i in 0..args.parent_mib {
            chunk.iter_mut().enumerate().for_each(|(j, b)| {
                *b = (i as usize).wrapping_mul(31).wrapping_add(j) as u8;
            });
            f.write_all(&chunk)?;
        }
        f.sync_all()?;
        Ok(())
    })?;
    store.commit("parent", "parent-active", Default::default())?;
    let parent_image = store.image_path("parent")?;
    let parent_alloc = fsops::usage_of([parent_image.as_path()])?.allocated_bytes;
    settle(&dir)?;

    // One Prepare (reflink) versus one full copy of the parent's image.
    let mut prepare = Vec::new();
    for i in 0..args.runs {
        let key = format!("single-{i}");
        let t = Instant::now();
        store.prepare(&key, Some("parent"), Default::default())?;
        prepare.push(t.elapsed());
        store.remove(&key)?;
    }
    let mut copy = Vec::new();
    let copy_dest = root.join("full-copy.img");
    for _ in 0..args.copy_runs {
        let t = Instant::now();
        fsops::sparse_copy(&parent_image, &copy_dest)?;
        fsops::sync_path(&copy_dest)?;
        copy.push(t.elapsed());
        fs::remove_file(&copy_dest)?;
        settle(&dir)?;
    }
    let prepare_s = Summary::of(&prepare);
    let copy_s = Summary::of(&copy);
    let ratio = copy_s.p50 / prepare_s.p50;

    // N concurrent Prepares from the parent.
    let used_before = fs_used(&dir)?;
    let t = Instant::now();
    let results: Vec<Result<Duration, twig_snapshotter::Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.children)
            .map(|i| {
                let store = &store;
                s.spawn(move || {
                    let t = Instant::now();
                    store
                        .prepare(&format!("child-{i}"), Some("parent"), Default::default())
                        .map(|_| t.elapsed())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(twig_snapshotter::Error::FailedPrecondition(
                        "prepare thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let wall = t.elapsed();
    let concurrent = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let concurrent_s = Summary::of(&concurrent);
    let used_after = fs_used(&dir)?;
    let usage = store.disk_usage()?;
    let children_logical = args.children as u64 * (image_mib << 20);

    eprintln!(
        "twig-bench snapshotter ({} MiB parent, {} allocated; root {})",
        args.parent_mib,
        human(parent_alloc),
        dir.display()
    );
    row("prepare child (reflink)", &prepare_s);
    row("full copy of parent image", &copy_s);
    eprintln!(
        "{:<28} {ratio:.0}x (copy p50 / reflink prepare p50)",
        "ratio"
    );
    row(
        &format!("{} concurrent prepares", args.children),
        &concurrent_s,
    );
    eprintln!(
        "{:<28} {:.1} ms wall, {:.0} prepares/s",
        "",
        wall.as_secs_f64() * 1e3,
        args.children as f64 / wall.as_secs_f64()
    );
    eprintln!(
        "{:<28} {} logical, {} new on disk ({} per child); images allocate {} but occupy {} distinct",
        format!("disk of {} children", args.children),
        human(children_logical),
        human(used_after.saturating_sub(used_before)),
        human(used_after.saturating_sub(used_before) / args.children as u64),
        human(usage.allocated_bytes),
        human(usage.unique_bytes),
    );

    Ok(json!({
        "clone_mode": store.clone_mode(),
        "parent_mib": args.parent_mib,
        "image_mib": image_mib,
        "parent_allocated_bytes": parent_alloc,
        "prepare_reflink_ms": prepare_s,
        "full_copy_ms": copy_s,
        "copy_over_reflink_ratio": ratio,
        "concurrent": {
            "children": args.children,
            "prepare_ms": concurrent_s,
            "wall_ms": wall.as_secs_f64() * 1e3,
        },
        "disk": {
            "children_logical_bytes": children_logical,
            "fs_used_delta_bytes": used_after.saturating_sub(used_before),
            "images_allocated_bytes": usage.allocated_bytes,
            "images_shared_bytes": usage.shared_bytes,
            "images_unique_bytes": usage.unique_bytes,
        },
    }))
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1024.0 * MIB {
        format!("{:.2} GiB", b / (1024.0 * MIB))
    } else if b >= MIB {
        format!("{:.1} MiB", b / MIB)
    } else {
        format!("{:.0} KiB", b / 1024.0)
    }
}
