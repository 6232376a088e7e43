//! The pool of prepared twig-net program sets with a real `twig-node` and
//! a real bpffs (mounted on a temporary directory): filled at start, a set
//! handed over by `AcquireNetSet` (its pins moved to the caller's
//! directory) and refilled, bad requests refused without losing a set, and
//! everything pooled removed when the daemon stops, while the handed-over
//! set stays the caller's. Needs root (BPF, mount).

mod common;

use std::path::{Path, PathBuf};

use common::*;
use twig_proto::node::AcquireNetSetRequest;

/// A bpffs mounted on a temporary directory, unmounted on drop.
struct Bpffs {
    dir: tempfile::TempDir,
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let path = std::ffi::CString::new(self.dir.path().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: umount2 of a NUL-terminated path that outlives the call.
        unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn acquire(node: &Node, dir: &str) -> Result<bool, ttrpc::Error> {
    node.pool
        .acquire_net_set(
            ttrpc::context::with_timeout(T.as_nanos() as i64),
            &AcquireNetSetRequest {
                dir: dir.into(),
                sandbox_id: "test-sandbox".into(),
                ..Default::default()
            },
        )
        .map(|r| r.taken)
}

#[test]
fn net_sets_are_prepared_handed_over_refilled_and_removed_at_stop() {
    let dir = tempfile::tempdir().unwrap();
    let bpffs = Bpffs {
        dir: tempfile::tempdir().unwrap(),
    };
    let root = bpffs.dir.path().to_path_buf();
    let pool_dir = root.join("pool");
    let mut config = config(dir.path(), 0);
    config["net_pool"] = serde_json::json!({ "size": 2, "dir": pool_dir });
    let node = Node::start(dir.path(), &config);
    wait_until("the daemon prepared 2 sets", T, || {
        node.status().net_sets_ready == 2
    });
    assert_eq!(names(&pool_dir).len(), 2, "{:?}", names(&pool_dir));

    let pod: PathBuf = root.join("pod-a");
    assert!(acquire(&node, pod.to_str().unwrap()).expect("AcquireNetSet"));
    let pins = names(&pod);
    for pin in [
        "config",
        "rules",
        "state",
        "counters",
        "attachment",
        "flows",
        "ready_tap",
        "ready_veth",
    ] {
        assert!(pins.iter().any(|p| p == pin), "{pin} missing in {pins:?}");
    }
    wait_until("the pool is refilled", T, || {
        node.status().net_sets_ready == 2
    });

    // Bad requests move nothing and spend no set.
    for (bad, code) in [
        ("relative/pod", ttrpc::Code::INVALID_ARGUMENT),
        (
            pool_dir.join("x").to_str().unwrap(),
            ttrpc::Code::INVALID_ARGUMENT,
        ),
        (pod.to_str().unwrap(), ttrpc::Code::FAILED_PRECONDITION),
    ] {
        let (got, message) = status(acquire(&node, bad).expect_err(bad));
        assert_eq!(got, code, "{bad}: {message}");
        assert!(message.contains(bad.trim_start_matches('/')), "{message}");
    }
    assert_eq!(node.status().net_sets_ready, 2);
    assert_eq!(names(&pod), pins, "the handed set is untouched");

    drop(node);
    assert!(
        !pool_dir.exists(),
        "the pool is removed at stop: {:?}",
        names(&pool_dir)
    );
    // A fresh bpffs shows the kernel's `maps.debug`/`progs.debug` at its root.
    let left: Vec<String> = names(&root)
        .into_iter()
        .filter(|n| !n.ends_with(".debug"))
        .collect();
    assert_eq!(left, ["pod-a"], "only the handed-over set is left");
    for pin in pins {
        std::fs::remove_file(pod.join(pin)).unwrap();
    }
    std::fs::remove_dir(&pod).unwrap();
}

#[test]
fn without_a_pool_nothing_is_taken() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &config(dir.path(), 0));
    let pod = dir.path().join("pod");
    assert!(!acquire(&node, pod.to_str().unwrap()).expect("AcquireNetSet"));
    assert!(!pod.exists());
    assert_eq!(node.status().net_sets_ready, 0);
}
