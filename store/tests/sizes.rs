//! A real store on the host's filesystem (copy mode where it cannot
//! reflink): a full and an incremental snapshot with sparse memory and
//! disks published, their sizes and the store's stats checked against
//! `st_blocks`, `statvfs` and the files' lengths.

use std::fs::{self, File};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use twig_store::{Artefact, Kind, NodeStore, SnapshotSizes};

const RAM: u64 = 16 << 20;
const DISK: u64 = 8 << 20;

fn allocated(path: &Path) -> u64 {
    fs::metadata(path).unwrap().blocks() * 512
}

/// A sparse file of `len` bytes with `data` at each offset.
fn sparse(path: &Path, len: u64, writes: &[(u64, usize)]) {
    let f = File::create(path).unwrap();
    f.set_len(len).unwrap();
    for &(offset, n) in writes {
        f.write_all_at(&vec![0xa5; n], offset).unwrap();
    }
    f.sync_all().unwrap();
}

/// Publishes `id` with sparse memory (`pages` pages written) and disk.
fn publish(store: &NodeStore, id: &str, parent: Option<&str>, pages: u64) {
    let mut staging = store.stage(id).unwrap();
    let writes: Vec<(u64, usize)> = (0..pages).map(|p| (p * 3 * 4096, 4096)).collect();
    sparse(&staging.path(Artefact::Memory), RAM, &writes);
    sparse(&staging.path(Artefact::Disk(0)), DISK, &[(0, 65536)]);
    staging.put_bytes(Artefact::State, &[1; 3000]).unwrap();
    match parent {
        Some(p) => staging.set_parent(p).unwrap(),
        None => staging.set_kind(Kind::Full),
    }
    staging.publish().unwrap();
}

fn expected(store: &NodeStore, id: &str) -> SnapshotSizes {
    let dir = store.snapshot_dir(id);
    SnapshotSizes {
        memory_bytes: allocated(&dir.join("memory")),
        disk_bytes: allocated(&dir.join("disk0")),
        restore_bytes: RAM + DISK,
    }
}

#[test]
fn sizes_and_stats_of_a_chain_match_the_files_on_disk() {
    let root = tempfile::tempdir().unwrap();
    let store = NodeStore::open(root.path(), true).unwrap();
    publish(&store, "template.ns.app", None, 200);
    publish(&store, "pod-snap-1", Some("template.ns.app"), 5);

    let full = store.sizes_of("template.ns.app").unwrap();
    let layer = store.sizes_of("pod-snap-1").unwrap();
    assert_eq!(full, expected(&store, "template.ns.app"));
    assert_eq!(layer, expected(&store, "pod-snap-1"));
    assert!(
        full.memory_bytes >= 200 * 4096 && full.memory_bytes < RAM,
        "{full:?}"
    );
    assert!(
        layer.memory_bytes >= 5 * 4096 && layer.memory_bytes < full.memory_bytes,
        "{layer:?}"
    );
    assert!(
        layer.disk_bytes >= 65536 && layer.disk_bytes < DISK,
        "{layer:?}"
    );
    assert_eq!(layer.restore_bytes, full.restore_bytes);

    let stats = store.stats(|s| s.id.starts_with("template.")).unwrap();
    let held = |id: &str| -> u64 {
        fs::read_dir(store.snapshot_dir(id))
            .unwrap()
            .map(|e| allocated(&e.unwrap().path()))
            .sum()
    };
    let (template_files, layer_files) = (held("template.ns.app"), held("pod-snap-1"));
    assert!(layer_files >= layer.memory_bytes + layer.disk_bytes);
    assert_eq!(
        stats.allocated_bytes,
        template_files + layer_files,
        "{stats:?}"
    );
    assert_eq!((stats.snapshots, stats.templates), (1, 1));
    let (capacity, free) = df(root.path());
    assert_eq!(stats.capacity_bytes, capacity);
    assert!(stats.free_bytes <= stats.capacity_bytes && stats.free_bytes > 0);
    // Other writers of the filesystem allocate and free between the two reads.
    assert!(
        stats.free_bytes.abs_diff(free) < 256 << 20,
        "{stats:?} {free}"
    );

    // A deletion gives its bytes back; a missing snapshot has no sizes.
    store.delete("pod-snap-1").unwrap();
    let after = store.stats(|s| s.id.starts_with("template.")).unwrap();
    assert_eq!(after.allocated_bytes, template_files, "{after:?}");
    assert_eq!((after.snapshots, after.templates), (0, 1));
    assert!(matches!(
        store.sizes_of("pod-snap-1"),
        Err(twig_store::Error::NotFound(_))
    ));
}

#[test]
fn an_empty_store_is_empty_and_staging_counts() {
    let root = tempfile::tempdir().unwrap();
    let store = NodeStore::open(root.path(), true).unwrap();
    let empty = store.stats(|_| false).unwrap();
    assert_eq!(
        (empty.allocated_bytes, empty.snapshots, empty.templates),
        (0, 0, 0)
    );
    let mut staging = store.stage("in-flight").unwrap();
    staging.put_bytes(Artefact::State, &[9; 10000]).unwrap();
    let busy = store.stats(|_| false).unwrap();
    assert_eq!(
        busy.allocated_bytes,
        allocated(&staging.path(Artefact::State))
    );
    assert_eq!(busy.snapshots, 0);
}

/// (capacity, free) of the filesystem holding `path`, from `df`'s own source.
fn df(path: &Path) -> (u64, u64) {
    let out = std::process::Command::new("stat")
        .args(["-f", "-c", "%S %b %a"])
        .arg(path)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let n: Vec<u64> = text
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    (n[0] * n[1], n[0] * n[2])
}
