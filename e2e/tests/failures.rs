//! The harness's failure path: a node that cannot come up says why and
//! leaves nothing behind (no processes, no mounts, no files); and a twig
//! container refused for its image's snapshotter. Built with
//! `--features lab`, like the tests that rely on this.

use std::fs;
use std::path::Path;
use std::time::Duration;

use twig_e2e::{poll_until, Node, NodeConfig, Runtime, IMAGE_REF};

/// PIDs of this process's children (running or not yet reaped).
fn children() -> Vec<i32> {
    let me = std::process::id().to_string();
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = fs::read_to_string(e.path().join("stat")).ok()?;
            // `pid (comm) state ppid ...`; comm may hold spaces and parens.
            let ppid = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?;
            (ppid == me).then_some(pid)
        })
        .collect()
}

fn mount_table() -> String {
    fs::read_to_string("/proc/self/mountinfo").expect("reading the mount table")
}

fn node_dirs(xfs: &Path) -> Vec<String> {
    fs::read_dir(xfs)
        .expect("reading the XFS dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("node-"))
        .collect()
}

#[test]
fn an_archive_that_is_no_image_fails_the_start_and_leaves_nothing_behind() {
    let mut config = NodeConfig::from_env().unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().expect("temp dir");
    config.image = dir.path().join("not-an-image.tar");
    fs::write(&config.image, "this is not a tar archive\n").expect("writing the bad archive");
    let mounts = mount_table();
    let dirs = config.xfs.as_deref().map(node_dirs);

    let err = Node::start_with(&config).expect_err("a text file cannot be imported as an image");

    let text = err.to_string();
    assert!(
        text.contains("images import") && text.contains("not-an-image.tar"),
        "the error names neither the command nor the archive: {text}"
    );
    assert_eq!(children(), Vec::<i32>::new(), "processes left running");
    assert_eq!(mount_table(), mounts, "mounts left behind");
    if let Some(xfs) = config.xfs.as_deref() {
        assert_eq!(
            Some(node_dirs(xfs)),
            dirs,
            "node directories left in {}",
            xfs.display()
        );
    }
}

/// An image on another snapshotter than twig's (containerd's `native`: the
/// lab's kernel has no overlayfs module; any mount that is not a twig block
/// image takes the same path in the shim): the twig shim refuses the
/// container with an error naming `--snapshotter twig`, before it takes a
/// VM; nothing stays (no container, no shim, no VMM handed over).
#[test]
fn twig_refuses_an_image_on_another_snapshotter_and_leaves_nothing() {
    assert!(
        twig_e2e::find_on_path(Runtime::Twig.shim()).is_some(),
        "containerd-shim-twig-v2 not found in the workspace build (not on PATH)"
    );
    let node = Node::start().unwrap_or_else(|e| panic!("the node did not start: {e}"));
    let out = node
        .ctr([
            "run",
            "--rm",
            "--runtime",
            Runtime::Twig.name(),
            "--snapshotter",
            "native",
            IMAGE_REF,
            "on-native",
            "echo",
            "ran",
        ])
        .unwrap_or_else(|e| panic!("{e}\n{}", node.logs()));
    assert!(!out.status.success(), "ran on native: {out}");
    assert!(
        out.stderr.contains("--snapshotter twig") && !out.stdout.contains("ran"),
        "the error does not name the snapshotter to use: {out}\n{}",
        node.logs()
    );
    let left = node
        .ctr_ok(["containers", "ls", "-q"])
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(left.trim().is_empty(), "containers left: {left}");
    let clean = poll_until(Duration::from_secs(60), || {
        node.shim_pids(Runtime::Twig.shim()).is_empty() && node.handed_vmms().is_empty()
    });
    assert!(
        clean,
        "left behind: shims {:?}, handed VMMs {:?}\n{}",
        node.shim_pids(Runtime::Twig.shim()),
        node.handed_vmms(),
        node.logs()
    );
}
