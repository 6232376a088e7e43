//! The harness's failure path: a node that cannot come up says why and
//! leaves nothing behind (no processes, no mounts, no files). Built with
//! `--features lab`, like the tests that rely on this.

use std::fs;
use std::path::Path;

use twig_e2e::{Node, NodeConfig};

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
