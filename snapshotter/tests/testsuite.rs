//! containerd's snapshotter test suite (core/snapshots/testsuite), ported to
//! the gRPC API of a real `twig-snapshotter` on a loop-mounted XFS, with the
//! same expectations; plus the error cases the issue lists. Every scenario
//! gets its own filesystem, process and socket.

mod common;

use common::fstest::{assert_same_tree, assert_tree_equals, Op};
use common::{Client, Mounted, Rig};
use std::collections::HashMap;
use std::time::SystemTime;
use tonic::Code;
use twig_snapshotter::api::snapshots::{
    CommitSnapshotRequest, Info, Kind, ListSnapshotsRequest, MountsRequest, PrepareSnapshotRequest,
    RemoveSnapshotRequest, StatSnapshotRequest, UpdateSnapshotRequest, UsageRequest,
    ViewSnapshotRequest,
};
use twig_snapshotter::api::types::Mount;

const NS: &str = "twig";

fn opt() -> HashMap<String, String> {
    HashMap::from([(
        "containerd.io/gc.root".to_string(),
        "2026-01-01T00:00:00Z".to_string(),
    )])
}

async fn prepare(c: &mut Client, key: &str, parent: &str) -> Result<Vec<Mount>, tonic::Status> {
    c.prepare(PrepareSnapshotRequest {
        snapshotter: NS.into(),
        key: key.into(),
        parent: parent.into(),
        labels: opt(),
    })
    .await
    .map(|r| r.into_inner().mounts)
}

async fn view(c: &mut Client, key: &str, parent: &str) -> Result<Vec<Mount>, tonic::Status> {
    c.view(ViewSnapshotRequest {
        snapshotter: NS.into(),
        key: key.into(),
        parent: parent.into(),
        labels: opt(),
    })
    .await
    .map(|r| r.into_inner().mounts)
}

async fn commit(c: &mut Client, name: &str, key: &str) -> Result<(), tonic::Status> {
    c.commit(CommitSnapshotRequest {
        snapshotter: NS.into(),
        name: name.into(),
        key: key.into(),
        labels: opt(),
    })
    .await
    .map(|_| ())
}

async fn stat(c: &mut Client, key: &str) -> Result<Info, tonic::Status> {
    c.stat(StatSnapshotRequest {
        snapshotter: NS.into(),
        key: key.into(),
    })
    .await
    .map(|r| r.into_inner().info.expect("stat reply has info"))
}

async fn remove(c: &mut Client, key: &str) -> Result<(), tonic::Status> {
    c.remove(RemoveSnapshotRequest {
        snapshotter: NS.into(),
        key: key.into(),
    })
    .await
    .map(|_| ())
}

async fn list(c: &mut Client, filters: &[&str]) -> Result<Vec<Info>, tonic::Status> {
    let mut stream = c
        .list(ListSnapshotsRequest {
            snapshotter: NS.into(),
            filters: filters.iter().map(|f| f.to_string()).collect(),
        })
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(batch) = stream.message().await? {
        out.extend(batch.info);
    }
    Ok(out)
}

async fn update(c: &mut Client, info: Info, paths: &[&str]) -> Result<Info, tonic::Status> {
    c.update(UpdateSnapshotRequest {
        snapshotter: NS.into(),
        info: Some(info),
        update_mask: Some(prost_types::FieldMask {
            paths: paths.iter().map(|p| p.to_string()).collect(),
        }),
    })
    .await
    .map(|r| r.into_inner().info.expect("update reply has info"))
}

fn kind(i: &Info) -> Kind {
    Kind::try_from(i.kind).expect("valid kind")
}

fn time(t: &Option<prost_types::Timestamp>) -> SystemTime {
    let t = t.as_ref().expect("timestamp set");
    SystemTime::UNIX_EPOCH + std::time::Duration::new(t.seconds as u64, t.nanos as u32)
}

/// Prepare on `parent`, mount, apply, unmount, commit as `name`.
async fn layer(rig: &Rig, c: &mut Client, name: &str, parent: &str, ops: &[Op]) {
    let key = format!("{name}-active");
    let mounts = prepare(c, &key, parent).await.expect("prepare");
    {
        let m = Mounted::new(&mounts, &rig.work, &key);
        common::fstest::apply(&m.path, ops);
    }
    commit(c, name, &key).await.expect("commit");
}

/// containerd's checkSnapshots: each layer on top of the previous, and a
/// view of each committed layer equals all layers so far applied in order.
async fn check_snapshots(layers: &[&[Op]]) {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    let mut parent = String::new();
    for (i, ops) in layers.iter().enumerate() {
        let name = format!("layer-{i}");
        layer(&rig, &mut c, &name, &parent, ops).await;
        let vkey = format!("view-{i}");
        let mounts = view(&mut c, &vkey, &name).await.expect("view");
        {
            let m = Mounted::new(&mounts, &rig.work, &vkey);
            assert_tree_equals(&m.path, &layers[..=i]);
        }
        remove(&mut c, &vkey).await.expect("remove view");
        parent = name;
    }
}

const INITIAL: &[Op] = &[
    Op::File("/foo", b"foo\n", 0o777),
    Op::Dir("/a", 0o755),
    Op::Dir("/a/b", 0o755),
    Op::Dir("/a/b/c", 0o755),
];
const DIFF: &[Op] = &[
    Op::File("/bar", b"bar\n", 0o777),
    Op::File("/foo", b"bar\n", 0o777),
    Op::RemoveAll("/a/b"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    let mounts = prepare(&mut c, "/work/preparing", "")
        .await
        .expect("prepare");
    assert!(!mounts.is_empty(), "expected mounts to have entries");
    {
        let m = Mounted::new(&mounts, &rig.work, "preparing");
        common::fstest::apply(&m.path, INITIAL);
    }
    commit(&mut c, "/work/committed", "/work/preparing")
        .await
        .expect("commit");
    let si = stat(&mut c, "/work/committed")
        .await
        .expect("stat committed");
    assert_eq!(si.parent, "");
    assert_eq!(kind(&si), Kind::Committed);
    assert_eq!(
        stat(&mut c, "/work/preparing").await.unwrap_err().code(),
        Code::NotFound,
        "the active key must be gone after Commit"
    );

    let mounts = prepare(&mut c, "/work/nextlayer", "/work/committed")
        .await
        .expect("prepare next");
    {
        let m = Mounted::new(&mounts, &rig.work, "nextlayer");
        assert_tree_equals(&m.path, &[INITIAL]);
        common::fstest::apply(&m.path, DIFF);
        let ni = stat(&mut c, "/work/nextlayer").await.expect("stat next");
        assert_eq!(ni.parent, "/work/committed");
        assert_eq!(kind(&ni), Kind::Active);
    }
    commit(&mut c, "/work/committed-next", "/work/nextlayer")
        .await
        .expect("commit next");
    let si2 = stat(&mut c, "/work/committed-next").await.expect("stat");
    assert_eq!(si2.parent, "/work/committed");
    assert_eq!(kind(&si2), Kind::Committed);
    assert_eq!(
        stat(&mut c, "/work/nextlayer").await.unwrap_err().code(),
        Code::NotFound
    );

    let walked = list(&mut c, &[]).await.expect("walk");
    for want in [&si, &si2] {
        let got = walked
            .iter()
            .find(|i| i.name == want.name)
            .unwrap_or_else(|| panic!("missing {} in walk", want.name));
        assert_eq!(got, want);
    }

    let mounts = view(&mut c, "/work/nextnextlayer", "/work/committed-next")
        .await
        .expect("view");
    {
        let m = Mounted::new(&mounts, &rig.work, "nextnextlayer");
        assert_tree_equals(&m.path, &[INITIAL, DIFF]);
    }
    remove(&mut c, "/work/nextnextlayer")
        .await
        .expect("remove view");
    let err = remove(&mut c, "/work/committed").await.unwrap_err();
    assert!(err.message().contains("remove"), "{err:?}");
    remove(&mut c, "/work/committed-next")
        .await
        .expect("remove");
    remove(&mut c, "/work/committed").await.expect("remove");
}

async fn stat_after_write(commit_it: bool) {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    let mounts = prepare(&mut c, "preparing", "").await.expect("prepare");
    assert!(!mounts.is_empty());
    {
        let m = Mounted::new(&mounts, &rig.work, "preparing");
        common::fstest::apply(&m.path, &[Op::File("/foo", b"foo\n", 0o777)]);
    }
    let name = if commit_it {
        commit(&mut c, "committed", "preparing")
            .await
            .expect("commit");
        "committed"
    } else {
        "preparing"
    };
    let si = stat(&mut c, name).await.expect("stat");
    assert_eq!(si.name, name);
    assert_eq!(
        kind(&si),
        if commit_it {
            Kind::Committed
        } else {
            Kind::Active
        }
    );
    assert_eq!(si.parent, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stat_active() {
    stat_after_write(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stat_committed() {
    stat_after_write(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transitivity() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    layer(
        &rig,
        &mut c,
        "snapA",
        "",
        &[Op::File("/foo", b"foo\n", 0o777)],
    )
    .await;
    layer(
        &rig,
        &mut c,
        "snapB",
        "snapA",
        &[Op::File("/foo", b"foo bar\n", 0o777)],
    )
    .await;
    let a = stat(&mut c, "snapA").await.unwrap();
    let b = stat(&mut c, "snapB").await.unwrap();
    let pb = stat(&mut c, &b.parent).await.unwrap();
    assert_eq!(a.parent, "");
    assert_eq!(b.parent, "snapA");
    assert_eq!(pb.parent, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_view_same_key_fails() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    layer(&rig, &mut c, "snapA", "", &[]).await;
    prepare(&mut c, "newlayer", "snapA").await.expect("prepare");
    assert_eq!(
        view(&mut c, "newlayer", "snapA").await.unwrap_err().code(),
        Code::AlreadyExists
    );
    prepare(&mut c, "prepLayer", "snapA")
        .await
        .expect("prepare");
    assert_eq!(
        prepare(&mut c, "prepLayer", "snapA")
            .await
            .unwrap_err()
            .code(),
        Code::AlreadyExists
    );
    view(&mut c, "viewLayer", "snapA").await.expect("view");
    assert_eq!(
        view(&mut c, "viewLayer", "snapA").await.unwrap_err().code(),
        Code::AlreadyExists
    );
}

/// c1 <- c2 <- a1, a2, c2 <- v1, v2 (containerd's baseTestSnapshots).
async fn base_snapshots(c: &mut Client) {
    prepare(c, "c1-a", "").await.unwrap();
    commit(c, "c1", "c1-a").await.unwrap();
    prepare(c, "c2-a", "c1").await.unwrap();
    commit(c, "c2", "c2-a").await.unwrap();
    prepare(c, "a1", "c2").await.unwrap();
    prepare(c, "a2", "").await.unwrap();
    view(c, "v1", "c2").await.unwrap();
    view(c, "v2", "").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_labels() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    let t1 = SystemTime::now();
    base_snapshots(&mut c).await;
    let t2 = SystemTime::now();
    let cases = [
        ("c1", Kind::Committed, ""),
        ("c2", Kind::Committed, "c1"),
        ("a1", Kind::Active, "c2"),
        ("a2", Kind::Active, ""),
        ("v1", Kind::View, "c2"),
        ("v2", Kind::View, ""),
    ];
    let root = "containerd.io/gc.root";
    for (name, k, parent) in cases {
        let mut st = stat(&mut c, name).await.unwrap();
        let created = time(&st.created_at);
        assert!(
            created >= t1 && created <= t2,
            "{name}: created {created:?}"
        );
        assert_eq!(st.created_at, st.updated_at, "{name}");
        assert_eq!(kind(&st), k, "{name}");
        assert_eq!(st.parent, parent, "{name}");
        assert_eq!(st.name, name);

        let labels = |kv: &[(&str, &str)]| -> HashMap<String, String> {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let expected = labels(&[("l1", "v1"), ("l2", "v2"), ("l3", "v3"), (root, "now")]);
        st.parent = "doesnotexist".into();
        st.labels = expected.clone();
        let u1 = SystemTime::now();
        let st2 = update(&mut c, st.clone(), &[]).await.expect("update");
        let u2 = SystemTime::now();
        assert_eq!(st2.created_at, st.created_at, "{name}: created changed");
        let updated = time(&st2.updated_at);
        assert!(
            updated >= u1 && updated <= u2,
            "{name}: updated {updated:?}"
        );
        assert_eq!(kind(&st2), k);
        assert_eq!(st2.parent, parent, "{name}: parent must not change");
        assert_eq!(st2.name, name);
        assert_eq!(st2.labels, expected);

        let mut st3 = st2.clone();
        st3.labels = labels(&[("l1", "updated"), ("l4", "v4")]);
        let st3 = update(&mut c, st3, &["labels.l1", "labels.l2"])
            .await
            .unwrap();
        assert_eq!(
            st3.labels,
            labels(&[("l1", "updated"), ("l3", "v3"), (root, "now")])
        );

        let mut st4 = st3.clone();
        st4.labels = labels(&[("l4", "v4"), (root, "now")]);
        let st4 = update(&mut c, st4, &["labels"]).await.unwrap();
        assert_eq!(st4.labels, labels(&[("l4", "v4"), (root, "now")]));

        let mut st5 = st4.clone();
        st5.parent = "doesnotexist".into();
        let err = update(&mut c, st5, &["parent"]).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{name}: {err:?}");
        assert_eq!(stat(&mut c, name).await.unwrap().labels, st4.labels);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_and_reuse_keys() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    prepare(&mut c, "committed-a", "").await.unwrap();
    commit(&mut c, "committed-1", "committed-a").await.unwrap();
    prepare(&mut c, "reuse-1", "committed-1").await.unwrap();
    remove(&mut c, "reuse-1").await.unwrap();
    view(&mut c, "reuse-1", "committed-1").await.unwrap();
    remove(&mut c, "reuse-1").await.unwrap();
    prepare(&mut c, "reuse-1", "").await.unwrap();
    remove(&mut c, "committed-1").await.unwrap();
    commit(&mut c, "committed-1", "reuse-1").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layer_file_update() {
    check_snapshots(&[
        &[
            Op::Dir("/etc", 0o700),
            Op::File("/etc/hosts", b"mydomain 10.0.0.1", 0o644),
            Op::File("/etc/profile", b"PATH=/usr/bin", 0o644),
        ],
        &[
            Op::File("/etc/hosts", b"mydomain 10.0.0.2", 0o644),
            Op::File("/etc/profile", b"PATH=/usr/bin", 0o666),
            Op::Dir("/root", 0o700),
            Op::File("/root/.bashrc", b"PATH=/usr/sbin:/usr/bin", 0o644),
        ],
        &[
            Op::File("/etc/hosts", b"mydomain 10.0.0.3", 0o600),
            Op::File(
                "/root/.bashrc",
                b"PATH=/usr/sbin:/usr/bin:/usr/local/bin",
                0o644,
            ),
        ],
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_directory_in_lower_layer() {
    check_snapshots(&[
        &[Op::Dir("/lib", 0o700), Op::File("/lib/hidden", b"", 0o644)],
        &[
            Op::RemoveAll("/lib"),
            Op::Dir("/lib", 0o755),
            Op::File("/lib/not-hidden", b"", 0o644),
        ],
        &[Op::File("/lib/newfile", b"", 0o644)],
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chown() {
    check_snapshots(&[
        &[
            Op::Dir("/opt", 0o700),
            Op::Dir("/opt/a", 0o700),
            Op::Dir("/opt/a/b", 0o700),
            Op::File("/opt/a/b/file.txt", b"hello", 0o644),
        ],
        &[
            Op::Chown("/opt", 1, 1),
            Op::Chown("/opt/a", 1, 1),
            Op::Chown("/opt/a/b", 1, 1),
            Op::Chown("/opt/a/b/file.txt", 1, 1),
        ],
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directory_permission_on_commit() {
    check_snapshots(&[
        &[
            Op::Dir("/dir1", 0o700),
            Op::Dir("/dir2", 0o700),
            Op::Dir("/dir3", 0o700),
            Op::Chown("/dir1", 1, 1),
            Op::Chown("/dir3", 1, 1),
        ],
        &[
            Op::Dir("/dir4", 0o700),
            Op::Chown("/dir4", 1, 1),
            Op::File("/dir1/file", b"", 0o644),
        ],
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_intermediate_snapshot() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    layer(&rig, &mut c, "committed-base", "", &[]).await;
    prepare(&mut c, "intermediate", "committed-base")
        .await
        .unwrap();
    commit(&mut c, "committed-inter", "intermediate")
        .await
        .unwrap();
    prepare(&mut c, "toplayer", "committed-inter")
        .await
        .unwrap();
    let err = remove(&mut c, "committed-inter").await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    remove(&mut c, "toplayer").await.unwrap();
    remove(&mut c, "committed-inter").await.unwrap();
    remove(&mut c, "committed-base").await.unwrap();
    assert!(list(&mut c, &[]).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_files_in_child_snapshot() {
    check_snapshots(&[
        &[
            Op::File("/foo", b"foo\n", 0o777),
            Op::File("/foobar", b"foobar\n", 0o777),
        ],
        &[Op::RemoveAll("/foobar")],
        &[],
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn move_file_from_lower_layer() {
    check_snapshots(&[
        &[
            Op::Dir("/dir1", 0o700),
            Op::File("/dir1/f1", b"Hello", 0o644),
            Op::Dir("dir2", 0o700),
            Op::File("dir2/f2", b"...", 0o644),
        ],
        &[
            Op::Dir("/dir3", 0o700),
            Op::File("/dir3/f1", b"Hello", 0o644),
            Op::RemoveAll("/dir1"),
            Op::Link("dir2/f2", "dir3/f2"),
            Op::RemoveAll("dir2/f2"),
        ],
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rename() {
    check_snapshots(&[
        &[
            Op::Dir("/dir1", 0o755),
            Op::Dir("/somefiles", 0o755),
            Op::File("/somefiles/f1", b"was here first!", 0o644),
            Op::File("/somefiles/f2", b"nothing interesting", 0o644),
        ],
        &[
            Op::Rename("/dir1", "/dir2"),
            Op::File("/somefiles/f1-overwrite", b"new content 1", 0o644),
            Op::Rename("/somefiles/f1-overwrite", "/somefiles/f1"),
            Op::Rename("/somefiles/f2", "/somefiles/f3"),
        ],
        &[
            Op::Symlink("f3", "/somefiles/f3-link"),
            Op::Link("/somefiles/f3", "/somefiles/f3-hard"),
        ],
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn view_readonly() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    prepare(&mut c, "preparing", "").await.unwrap();
    commit(&mut c, "committed", "preparing").await.unwrap();
    let mounts = view(&mut c, "view", "committed").await.unwrap();
    assert!(mounts[0].options.iter().any(|o| o == "ro"), "{mounts:?}");
    {
        let m = Mounted::new(&mounts, &rig.work, "view-mount");
        let err = std::fs::write(m.path.join("testfile"), b"testcontent")
            .expect_err("writing to a view must fail");
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    }
    remove(&mut c, "view").await.unwrap();
    remove(&mut c, "committed").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stat_in_walk() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    prepare(&mut c, "active-1", "").await.unwrap();
    commit(&mut c, "committed-1", "active-1").await.unwrap();
    prepare(&mut c, "active-2", "committed-1").await.unwrap();
    view(&mut c, "view-1", "committed-1").await.unwrap();
    let mut stream = c
        .list(ListSnapshotsRequest {
            snapshotter: NS.into(),
            filters: vec![],
        })
        .await
        .unwrap()
        .into_inner();
    let mut c2 = rig.snap.client().await;
    let mut seen = 0;
    while let Some(batch) = stream.message().await.unwrap() {
        for info in batch.info {
            assert_eq!(stat(&mut c2, &info.name).await.unwrap(), info);
            seen += 1;
        }
    }
    assert_eq!(seen, 3);
}

/// CloseTwice: the process shuts down cleanly, and again after a restart,
/// with its state intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_twice() {
    let mut rig = Rig::new();
    {
        let mut c = rig.snap.client().await;
        prepare(&mut c, "closeTwice-prepare", "").await.unwrap();
        commit(&mut c, "closeTwice", "closeTwice-prepare")
            .await
            .unwrap();
        prepare(&mut c, "kept", "closeTwice").await.unwrap();
        remove(&mut c, "kept").await.unwrap();
    }
    for _ in 0..2 {
        rig.snap.daemon.stop();
        rig.snap = common::Snapshotter::start(&rig.snap.root, &rig.snap.socket);
    }
    let mut c = rig.snap.client().await;
    assert_eq!(
        kind(&stat(&mut c, "closeTwice").await.unwrap()),
        Kind::Committed
    );
    remove(&mut c, "closeTwice").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_and_change_nothing() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    layer(&rig, &mut c, "base", "", &[Op::File("/f", b"x", 0o644)]).await;
    prepare(&mut c, "active", "base").await.unwrap();
    view(&mut c, "view", "base").await.unwrap();
    let before = list(&mut c, &[]).await.unwrap();

    let e = prepare(&mut c, "x", "no-such-parent").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = prepare(&mut c, "x", "active").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "active parent: {e:?}");
    let e = prepare(&mut c, "", "").await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = commit(&mut c, "c", "view").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "commit a view: {e:?}");
    let e = commit(&mut c, "c", "base").await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::FailedPrecondition,
        "commit committed: {e:?}"
    );
    let e = commit(&mut c, "c", "missing").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = commit(&mut c, "base", "active").await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::AlreadyExists,
        "commit onto a taken name: {e:?}"
    );
    let e = remove(&mut c, "base").await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::FailedPrecondition,
        "remove with children: {e:?}"
    );
    let e = remove(&mut c, "missing").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = c
        .mounts(MountsRequest {
            snapshotter: NS.into(),
            key: "base".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::FailedPrecondition,
        "mounts of committed: {e:?}"
    );
    let e = list(&mut c, &["name~=ba.*"]).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    assert_eq!(list(&mut c, &[]).await.unwrap(), before);
    let m = c
        .mounts(MountsRequest {
            snapshotter: NS.into(),
            key: "active".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .mounts;
    let mounted = Mounted::new(&m, &rig.work, "active");
    assert_eq!(std::fs::read(mounted.path.join("f")).unwrap(), b"x");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_filters_and_usage() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    layer(
        &rig,
        &mut c,
        "base",
        "",
        &[Op::File("/big", &[7u8; 1 << 20], 0o644)],
    )
    .await;
    prepare(&mut c, "child", "base").await.unwrap();
    view(&mut c, "v", "base").await.unwrap();
    let names = |infos: Vec<Info>| -> Vec<String> { infos.into_iter().map(|i| i.name).collect() };
    assert_eq!(
        names(list(&mut c, &["kind==committed"]).await.unwrap()),
        ["base"]
    );
    assert_eq!(
        names(
            list(&mut c, &["parent==base", "name==nothing"])
                .await
                .unwrap()
        ),
        ["child", "v"]
    );
    assert_eq!(
        names(
            list(&mut c, &[r#"labels."containerd.io/gc.root",kind!=view"#])
                .await
                .unwrap()
        ),
        ["base", "child"]
    );

    // A fresh child shares all of its parent's blocks: nearly no own usage.
    let usage = |key: &str| UsageRequest {
        snapshotter: NS.into(),
        key: key.into(),
    };
    let child = c.usage(usage("child")).await.unwrap().into_inner();
    assert!(
        child.size < 64 << 10,
        "fresh child owns {} bytes",
        child.size
    );
    assert!(child.inodes > 10, "{child:?}");
    {
        let m = c
            .mounts(MountsRequest {
                snapshotter: NS.into(),
                key: "child".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .mounts;
        let mounted = Mounted::new(&m, &rig.work, "child");
        std::fs::write(mounted.path.join("new"), vec![1u8; 2 << 20]).unwrap();
    }
    let child = c.usage(usage("child")).await.unwrap().into_inner();
    assert!(
        child.size >= 2 << 20,
        "written child owns only {} bytes",
        child.size
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_permission() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    let mounts = prepare(&mut c, "preparing", "").await.unwrap();
    let m = Mounted::new(&mounts, &rig.work, "preparing");
    let meta = std::fs::metadata(&m.path).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o7777,
        0o755
    );
    assert_eq!(
        std::fs::read_dir(&m.path).unwrap().count(),
        0,
        "a new snapshot is empty (no lost+found)"
    );
}

/// containerd's 128LayersMount: a chain of 128 layers; before and after
/// applying each layer the mounted snapshot equals a flat directory that got
/// the same changes, and a view of the top equals it at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_128_mount() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let mut layers: Vec<Vec<Op>> = vec![vec![
        Op::File("/bottom", b"way at the bottom\n", 0o777),
        Op::File("/overwriteme", b"FIRST!\n", 0o777),
        Op::Dir("/addhere", 0o755),
        Op::Dir("/onlyme", 0o755),
        Op::File("/onlyme/bottom", b"bye!\n", 0o777),
    ]];
    for i in 1..=127 {
        layers.push(vec![
            Op::File(
                "/overwriteme",
                leak(format!("{i} WAS HERE!\n")).as_bytes(),
                0o777,
            ),
            Op::File(leak(format!("/addhere/file-{i}")), b"same\n", 0o755),
            Op::RemoveAll("/onlyme"),
            Op::Dir("/onlyme", 0o755),
            Op::File(leak(format!("/onlyme/file-{i}")), b"only me!\n", 0o777),
        ]);
    }
    let flat = tempfile::tempdir().unwrap();
    let mut parent = String::new();
    for (i, ops) in layers.iter().enumerate() {
        let key = format!("prepare-layer-{i}");
        let mounts = prepare(&mut c, &key, &parent).await.expect("prepare");
        {
            let m = Mounted::new(&mounts, &rig.work, &key);
            assert_same_tree(flat.path(), &m.path);
            common::fstest::apply(flat.path(), ops);
            common::fstest::apply(&m.path, ops);
            assert_same_tree(flat.path(), &m.path);
        }
        parent = format!("committed-{i}");
        commit(&mut c, &parent, &key).await.expect("commit");
    }
    let mounts = view(&mut c, "fullview", &parent).await.expect("view");
    let m = Mounted::new(&mounts, &rig.work, "fullview");
    assert_same_tree(flat.path(), &m.path);
}

/// containerd's Walk: filters on kind, name, parent and labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walk_with_filters() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    let labels = |l: Option<&str>| {
        let mut m = HashMap::from([(
            "containerd.io/gc.root".to_string(),
            "check-walk".to_string(),
        )]);
        if let Some(v) = l {
            m.insert("l".to_string(), v.to_string());
        }
        m
    };
    let req = |key: &str, parent: &str, l: Option<&str>| PrepareSnapshotRequest {
        snapshotter: NS.into(),
        key: key.into(),
        parent: parent.into(),
        labels: labels(l),
    };
    let view_req = |key: &str, parent: &str, l: Option<&str>| ViewSnapshotRequest {
        snapshotter: NS.into(),
        key: key.into(),
        parent: parent.into(),
        labels: labels(l),
    };
    let commit_req = |name: &str, key: &str, l: Option<&str>| CommitSnapshotRequest {
        snapshotter: NS.into(),
        name: name.into(),
        key: key.into(),
        labels: labels(l),
    };
    c.prepare(req("a-np", "", None)).await.unwrap();
    c.prepare(req("p-tmp", "", None)).await.unwrap();
    c.commit(commit_req("p", "p-tmp", None)).await.unwrap();
    c.prepare(req("a", "p", None)).await.unwrap();
    c.view(view_req("v", "p", None)).await.unwrap();
    c.prepare(req("p-wl-tmp", "", None)).await.unwrap();
    c.commit(commit_req("p-wl", "p-wl-tmp", Some("1")))
        .await
        .unwrap();
    c.prepare(req("a-wl", "p-wl", Some("2"))).await.unwrap();
    c.view(view_req("v-wl", "p-wl", Some("3"))).await.unwrap();
    c.prepare(req("a-np-wl", "", Some("2"))).await.unwrap();

    let cases: &[(&[&str], &[&str])] = &[
        (
            &["a-np", "p", "a", "v", "p-wl", "a-wl", "v-wl", "a-np-wl"],
            &[r#"labels."containerd.io/gc.root"==check-walk"#],
        ),
        (
            &["a-np", "a", "a-wl", "a-np-wl"],
            &[r#"kind==active,labels."containerd.io/gc.root"==check-walk"#],
        ),
        (
            &["v", "v-wl"],
            &[r#"kind==view,labels."containerd.io/gc.root"==check-walk"#],
        ),
        (
            &["p", "p-wl"],
            &[r#"kind==committed,labels."containerd.io/gc.root"==check-walk"#],
        ),
        (&["p", "a-np-wl"], &["name==p", "name==a-np-wl"]),
        (&["a-wl"], &["name==a-wl,labels.l"]),
        (&["a", "v"], &["parent==p"]),
        (
            &["a", "v", "a-wl", "v-wl"],
            &[r#"parent!="",labels."containerd.io/gc.root"==check-walk"#],
        ),
        (&["p-wl", "a-wl", "v-wl", "a-np-wl"], &["labels.l"]),
        (&["a-wl", "a-np-wl"], &["labels.l==2"]),
    ];
    for (i, (want, filters)) in cases.iter().enumerate() {
        let mut got: Vec<String> = list(&mut c, filters)
            .await
            .unwrap()
            .into_iter()
            .map(|i| i.name)
            .collect();
        got.sort();
        let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
        want.sort();
        assert_eq!(got, want, "case {i}: filters {filters:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_removes_leftovers_only() {
    let rig = Rig::new();
    let mut c = rig.snap.client().await;
    prepare(&mut c, "a", "").await.unwrap();
    let tmp = rig.snap.root.join("tmp");
    std::fs::create_dir(tmp.join("999")).unwrap();
    std::fs::write(tmp.join("999/rootfs.img"), b"half-made").unwrap();
    std::fs::write(tmp.join("7.3.info"), b"{").unwrap();
    c.cleanup(twig_snapshotter::api::snapshots::CleanupRequest {
        snapshotter: NS.into(),
    })
    .await
    .expect("cleanup");
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0);
    assert_eq!(kind(&stat(&mut c, "a").await.unwrap()), Kind::Active);
    assert_eq!(list(&mut c, &[]).await.unwrap().len(), 1);
}
