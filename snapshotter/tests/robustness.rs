//! Concurrency, crash safety (kill -9 during Prepare and Commit), refusal of
//! filesystems without reflink, the explicit copy fallback, and a full disk.

mod common;

use common::{Client, LoopFs, Mounted, Rig, Snapshotter};
use std::collections::HashMap;
use std::fs;
use std::path::Path;
use tonic::Code;
use twig_snapshotter::api::snapshots::{
    CommitSnapshotRequest, Info, Kind, MountsRequest, PrepareSnapshotRequest, StatSnapshotRequest,
    UsageRequest,
};
use twig_snapshotter::api::types::Mount;

async fn prepare(c: &mut Client, key: &str, parent: &str) -> Result<Vec<Mount>, tonic::Status> {
    c.prepare(PrepareSnapshotRequest {
        snapshotter: "twig".into(),
        key: key.into(),
        parent: parent.into(),
        labels: HashMap::new(),
    })
    .await
    .map(|r| r.into_inner().mounts)
}

async fn commit(c: &mut Client, name: &str, key: &str) -> Result<(), tonic::Status> {
    c.commit(CommitSnapshotRequest {
        snapshotter: "twig".into(),
        name: name.into(),
        key: key.into(),
        labels: HashMap::new(),
    })
    .await
    .map(|_| ())
}

async fn stat(c: &mut Client, key: &str) -> Result<Info, tonic::Status> {
    c.stat(StatSnapshotRequest {
        snapshotter: "twig".into(),
        key: key.into(),
    })
    .await
    .map(|r| r.into_inner().info.expect("info"))
}

async fn mounts(c: &mut Client, key: &str) -> Vec<Mount> {
    c.mounts(MountsRequest {
        snapshotter: "twig".into(),
        key: key.into(),
    })
    .await
    .unwrap_or_else(|e| panic!("mounts of {key}: {e:?}"))
    .into_inner()
    .mounts
}

/// A committed `base` holding /shared.
async fn base(rig: &Rig, c: &mut Client) {
    let m = prepare(c, "base-active", "").await.expect("prepare base");
    {
        let mounted = Mounted::new(&m, &rig.work, "base");
        fs::write(mounted.path.join("shared"), b"from the parent\n").unwrap();
    }
    commit(c, "base", "base-active").await.expect("commit base");
}

/// Entries in the store's staging directory.
fn tmp_entries(root: &Path) -> Vec<String> {
    fs::read_dir(root.join("tmp"))
        .expect("tmp dir")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// Every listed snapshot is complete on disk and every snapshot dir is listed.
async fn assert_consistent(snap: &Snapshotter, c: &mut Client) -> Vec<Info> {
    let infos = common::list_all(c).await;
    let dirs = fs::read_dir(snap.root.join("snapshots")).unwrap().count();
    assert_eq!(dirs, infos.len(), "snapshot dirs vs listed snapshots");
    for i in &infos {
        assert_eq!(&stat(c, &i.name).await.expect("stat listed"), i);
    }
    assert_eq!(
        tmp_entries(&snap.root),
        Vec::<String>::new(),
        "staging leftovers"
    );
    infos
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_concurrent_prepares_from_one_parent() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    base(&rig, &mut c).await;
    let tasks: Vec<_> = (0..100)
        .map(|i| {
            let mut c = c.clone();
            tokio::spawn(async move { prepare(&mut c, &format!("child-{i}"), "base").await })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let m = t
            .await
            .expect("task")
            .unwrap_or_else(|e| panic!("child-{i}: {e:?}"));
        assert_eq!(m.len(), 1);
    }
    let infos = common::list_all(&mut c).await;
    assert_eq!(infos.len(), 101);
    let children: Vec<&Info> = infos
        .iter()
        .filter(|i| i.name.starts_with("child-"))
        .collect();
    assert_eq!(children.len(), 100);
    assert!(children
        .iter()
        .all(|i| i.parent == "base" && i.kind == Kind::Active as i32));
    // Independent: each child sees the parent's file and none of the marks
    // written into the children before it.
    for i in 0..100 {
        let key = format!("child-{i}");
        let m = mounts(&mut c, &key).await;
        let mounted = Mounted::new(&m, &rig.work, &key);
        assert_eq!(
            fs::read(mounted.path.join("shared")).unwrap(),
            b"from the parent\n"
        );
        assert!(
            !mounted.path.join("mark").exists(),
            "{key} sees another child's write"
        );
        fs::write(mounted.path.join("mark"), key.as_bytes()).unwrap();
    }
    for i in [0, 57, 99] {
        let key = format!("child-{i}");
        let m = mounts(&mut c, &key).await;
        let mounted = Mounted::new(&m, &rig.work, &format!("{key}-again"));
        assert_eq!(fs::read(mounted.path.join("mark")).unwrap(), key.as_bytes());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_during_prepare_leaves_a_clean_store() {
    let mut rig = Rig::new();
    let mut c = rig.snap.client().await;
    base(&rig, &mut c).await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..60 {
        let mut c = c.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let key = format!("p-{i}");
            let r = prepare(&mut c, &key, "base").await;
            let _ = tx.send((key, r.is_ok()));
        });
    }
    drop(tx);
    // Kill as soon as the first Prepare is acknowledged, with the others in
    // flight.
    let mut acked = Vec::new();
    if let Some((key, ok)) = rx.recv().await {
        rig.snap.daemon.kill9();
        if ok {
            acked.push(key);
        }
    }
    while let Some((key, ok)) = rx.recv().await {
        if ok {
            acked.push(key);
        }
    }
    let leftovers = tmp_entries(&rig.snap.root).len();
    eprintln!(
        "killed with {} prepares acknowledged, {leftovers} staging entries",
        acked.len()
    );
    assert!(!acked.is_empty());

    rig.snap = Snapshotter::start(&rig.snap.root, &rig.snap.socket);
    let mut c = rig.snap.client().await;
    let infos = assert_consistent(&rig.snap, &mut c).await;
    for key in &acked {
        assert!(
            infos.iter().any(|i| &i.name == key),
            "acknowledged {key} lost"
        );
    }
    // Every snapshot that survived is usable; every one that did not can be
    // prepared again.
    for i in 0..60 {
        let key = format!("p-{i}");
        match stat(&mut c, &key).await {
            Ok(info) => {
                assert_eq!(info.parent, "base");
                let m = mounts(&mut c, &key).await;
                let mounted = Mounted::new(&m, &rig.work, &key);
                assert_eq!(
                    fs::read(mounted.path.join("shared")).unwrap(),
                    b"from the parent\n"
                );
            }
            Err(e) => {
                assert_eq!(e.code(), Code::NotFound, "{key}: {e:?}");
                prepare(&mut c, &key, "base").await.expect("re-prepare");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_during_commit_leaves_a_clean_store() {
    let mut rig = Rig::new();
    let mut c = rig.snap.client().await;
    base(&rig, &mut c).await;
    for i in 0..40 {
        prepare(&mut c, &format!("a-{i}"), "base")
            .await
            .expect("prepare");
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..40 {
        let mut c = c.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let r = commit(&mut c, &format!("c-{i}"), &format!("a-{i}")).await;
            let _ = tx.send((i, r.is_ok()));
        });
    }
    drop(tx);
    let mut acked = Vec::new();
    if let Some((i, ok)) = rx.recv().await {
        rig.snap.daemon.kill9();
        if ok {
            acked.push(i);
        }
    }
    while let Some((i, ok)) = rx.recv().await {
        if ok {
            acked.push(i);
        }
    }
    eprintln!("killed with {} commits acknowledged", acked.len());

    rig.snap = Snapshotter::start(&rig.snap.root, &rig.snap.socket);
    let mut c = rig.snap.client().await;
    let infos = assert_consistent(&rig.snap, &mut c).await;
    assert_eq!(infos.len(), 41, "base plus one snapshot per pair");
    for i in 0..40 {
        let active = stat(&mut c, &format!("a-{i}")).await;
        let committed = stat(&mut c, &format!("c-{i}")).await;
        match (active, committed) {
            (Ok(a), Err(e)) => {
                assert_eq!(e.code(), Code::NotFound);
                assert_eq!(a.kind, Kind::Active as i32);
                assert!(!acked.contains(&i), "acknowledged commit c-{i} lost");
                commit(&mut c, &format!("c-{i}"), &format!("a-{i}"))
                    .await
                    .expect("commit again");
            }
            (Err(e), Ok(s)) => {
                assert_eq!(e.code(), Code::NotFound);
                assert_eq!(s.kind, Kind::Committed as i32);
                assert_eq!(s.parent, "base");
            }
            other => panic!("pair {i} is half-committed: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_a_filesystem_without_reflink_unless_allow_copy() {
    let ext4 = LoopFs::ext4(256);
    let root = ext4.path().join("store");
    let socket = ext4.dir.path().join("snap.sock");
    let log = Snapshotter::try_start(&root, &socket, &[])
        .err()
        .expect("must refuse to start on ext4");
    assert!(log.contains("does not support reflinks"), "{log}");
    assert!(log.contains("--allow-copy"), "{log}");
    assert!(log.contains("exited with exit status: 1"), "{log}");

    let snap = Snapshotter::try_start(&root, &socket, &["--allow-copy"])
        .unwrap_or_else(|log| panic!("--allow-copy must start: {log}"));
    let mut c = snap.client().await;
    let work = ext4.dir.path().join("work");
    let m = prepare(&mut c, "a", "").await.expect("prepare");
    {
        let mounted = Mounted::new(&m, &work, "a");
        fs::write(mounted.path.join("f"), vec![3u8; 1 << 20]).unwrap();
    }
    commit(&mut c, "c", "a").await.expect("commit");
    let m = prepare(&mut c, "child", "c").await.expect("prepare child");
    let mounted = Mounted::new(&m, &work, "child");
    assert_eq!(
        fs::read(mounted.path.join("f")).unwrap(),
        vec![3u8; 1 << 20]
    );
    // A copy shares nothing: the child owns at least the file's megabyte.
    let usage = c
        .usage(UsageRequest {
            snapshotter: "twig".into(),
            key: "child".into(),
        })
        .await
        .expect("usage")
        .into_inner();
    assert!(
        usage.size >= 1 << 20,
        "copied child owns {} bytes",
        usage.size
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_disk_fails_cleanly_and_loses_nothing() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    base(&rig, &mut c).await;
    prepare(&mut c, "active", "base").await.expect("prepare");
    let before = common::list_all(&mut c).await;

    let filler = rig.xfs.fill_up();
    let e = prepare(&mut c, "doomed", "base").await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::ResourceExhausted,
        "prepare on a full disk: {e:?}"
    );
    assert!(e.message().contains("no space"), "{e:?}");
    let e = commit(&mut c, "committed", "active").await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::ResourceExhausted,
        "commit on a full disk: {e:?}"
    );
    assert_eq!(
        common::list_all(&mut c).await,
        before,
        "a failed call changed the store"
    );
    assert_eq!(
        stat(&mut c, "doomed").await.unwrap_err().code(),
        Code::NotFound
    );

    fs::remove_dir_all(&filler).unwrap();
    prepare(&mut c, "doomed", "base")
        .await
        .expect("prepare after freeing space");
    commit(&mut c, "committed", "active")
        .await
        .expect("commit after freeing space");
    assert_consistent(&rig.snap, &mut c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_snapshotter_on_one_store_is_refused() {
    let rig = Rig::new();
    let log = Snapshotter::try_start(&rig.snap.root, &rig.xfs.dir.path().join("second.sock"), &[])
        .err()
        .expect("a second process on the same store must not start");
    assert!(log.contains("locked by another process"), "{log}");
    let mut c = rig.snap.client().await;
    prepare(&mut c, "still-works", "")
        .await
        .expect("first instance unaffected");
}
