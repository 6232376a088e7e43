//! Snapshots through a real registry (Debian's `docker-registry`, started
//! and stopped by the test): a VM snapshotted into one node store is pulled
//! into another and continues there with its memory and disk; incremental
//! snapshots move only their delta; corrupt blobs and a registry that goes
//! away mid-pull leave nothing behind. Needs /dev/kvm (the ring-3 test
//! guest) and `docker-registry`.

mod common;

use common::*;

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use twig_cri::harness::Registry;
use twig_oci::artifact::DIGEST_LABEL;
use twig_oci::{Error, Reference};
use twig_vmm::testguest::{self, Command};
use twig_vmm::{Capture, Kind, Shape, Vm};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_snapshot_chain_moves_to_another_node_store_and_continues_there() {
    let d = tempfile::tempdir().unwrap();
    let registry = Registry::start(&d.path().join("registry")).expect("docker-registry");
    let (a, b) = (store(&d.path().join("a")), store(&d.path().join("b")));
    let c = client(&registry.host());
    let rw = d.path().join("rw.img");
    std::fs::write(&rw, vec![0xa1u8; DISK]).unwrap();
    let mut g = boot(d.path(), &rw);
    dirty(&mut g.vm, 0, 8, 100);
    take(&mut g.vm, &a, "base", Kind::Full);
    write_at(&rw, 8192, b"incremental");
    dirty(&mut g.vm, 0, 4, 200);
    take(&mut g.vm, &a, "inc", Kind::Incremental);
    let disk_at_inc = std::fs::read(&rw).unwrap();

    let v1 = reference(&registry.host(), "v1");
    let pushed = twig_oci::push(&c, &a, "inc", &v1).await.unwrap();
    assert_eq!(
        (pushed.snapshots_pushed, pushed.snapshots_present),
        (2, 0),
        "{pushed:?}"
    );
    assert!(
        pushed.bytes_uploaded < 8 << 20,
        "only the pages the guest touched travel, not its {MIB} MiB: {pushed:?}"
    );
    assert_eq!(a.get("inc").unwrap().labels[DIGEST_LABEL], pushed.digest);

    // The guest goes on; a second incremental snapshot pushes its delta only.
    dirty(&mut g.vm, 0, 2, 300);
    write_at(&rw, 0, b"third");
    take(&mut g.vm, &a, "inc2", Kind::Incremental);
    let v2 = reference(&registry.host(), "v2");
    let delta = twig_oci::push(&c, &a, "inc2", &v2).await.unwrap();
    assert_eq!(
        (delta.snapshots_pushed, delta.snapshots_present),
        (1, 2),
        "{delta:?}"
    );
    assert!(
        delta.bytes_uploaded < 256 << 10,
        "an incremental snapshot uploads its own pages and disk extents: {delta:?}"
    );
    let again = twig_oci::push(&c, &a, "inc2", &v2).await.unwrap();
    assert_eq!(
        (again.bytes_uploaded, again.snapshots_present),
        (0, 3),
        "{again:?}"
    );

    // Another node's store pulls v1, parent first, and a VM continues from it.
    let pulled = twig_oci::pull(&c, &b, &v1, Some(OWNER)).await.unwrap();
    assert_eq!(pulled.snapshots_pulled, 2, "{pulled:?}");
    assert_eq!(pulled.digest, pushed.digest);
    let snap = b.get(&pulled.id).unwrap();
    assert_eq!(snap.owner.as_deref(), Some(OWNER));
    assert_eq!(snap.labels[DIGEST_LABEL], pushed.digest);
    let rw2 = d.path().join("rw2.img");
    std::fs::write(&rw2, b"").unwrap();
    let serial = Capture::new();
    let mut r = Vm::create_with(Shape::new(MIB, 1), serial.writer(), &disk(&rw2)).unwrap();
    r.restore(snap.dir()).unwrap();
    assert_eq!(word(&r, 0), 200, "the incremental snapshot's page");
    assert_eq!(word(&r, 5), 105, "a page only its parent holds");
    assert!(
        std::fs::read(&rw2).unwrap() == disk_at_inc,
        "the disk as it was at the snapshot"
    );
    dirty(&mut r, 0, 1, 7);
    assert_eq!(word(&r, 0), 7, "the restored guest runs");
    let from = serial.bytes().len();
    testguest::run(&mut r, Command::Print, [b'b' as u64, 0, 0], T).unwrap();
    serial.wait_for(b"b", from, T).unwrap();

    // v2 on top of what it has: only its own snapshot is fetched.
    let next = twig_oci::pull(&c, &b, &v2, Some(OWNER)).await.unwrap();
    assert_eq!(next.snapshots_pulled, 1, "{next:?}");
    assert!(next.bytes_downloaded < 256 << 10, "{next:?}");
    let rw3 = d.path().join("rw3.img");
    std::fs::write(&rw3, b"").unwrap();
    let mut r2 =
        Vm::create_with(Shape::new(MIB, 1), Box::new(std::io::sink()), &disk(&rw3)).unwrap();
    r2.restore(&b.snapshot_dir(&next.id)).unwrap();
    assert_eq!((word(&r2, 0), word(&r2, 3), word(&r2, 6)), (300, 203, 106));
    assert!(std::fs::read(&rw3).unwrap()[..5] == *b"third");
    let same = twig_oci::pull(&c, &b, &v1, Some(OWNER)).await.unwrap();
    assert_eq!(
        (same.id, same.snapshots_pulled, same.bytes_downloaded),
        (pulled.id.clone(), 0, 0)
    );

    // Pulled under an id of the caller's choosing (a template's), even
    // where the store has it under another: its parent as pulled before.
    let named = twig_oci::pull_as(&c, &b, &v1, Some(OWNER), "template.team-a.agent")
        .await
        .unwrap();
    assert_eq!(
        (named.id.as_str(), named.snapshots_pulled),
        ("template.team-a.agent", 1)
    );
    let t = b.get("template.team-a.agent").unwrap();
    assert_eq!(t.parent, b.get(&pulled.id).unwrap().parent);
    let mut r3 =
        Vm::create_with(Shape::new(MIB, 1), Box::new(std::io::sink()), &disk(&rw3)).unwrap();
    r3.restore(t.dir()).unwrap();
    assert_eq!((word(&r3, 0), word(&r3, 5)), (200, 105));
    assert!(matches!(
        twig_oci::pull_as(&c, &b, &v1, Some(OWNER), "../x").await,
        Err(Error::Store(_))
    ));

    // Another namespace may not pull it, nor restore what is here.
    let before = b.list().unwrap().len();
    match twig_oci::pull(&c, &b, &v1, Some("team-b")).await {
        Err(Error::PermissionDenied(m)) => assert!(m.contains("team-a"), "{m}"),
        other => panic!("another namespace pulled it: {other:?}"),
    }
    let other = store(&d.path().join("c"));
    assert!(matches!(
        twig_oci::pull(&c, &other, &v1, Some("team-b")).await,
        Err(Error::PermissionDenied(_))
    ));
    assert_clean(&other);
    assert_eq!(b.list().unwrap().len(), before);
    // The source guest was never disturbed by the pushes.
    let from = g.serial.bytes().len();
    testguest::run(&mut g.vm, Command::Print, [b'a' as u64, 0, 0], T).unwrap();
    g.serial.wait_for(b"a", from, T).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_blob_is_refused_and_nothing_is_published() {
    let d = tempfile::tempdir().unwrap();
    let registry = Registry::start(&d.path().join("registry")).expect("docker-registry");
    let c = client(&registry.host());
    let to = reference(&registry.host(), "v1");
    pushed_full(d.path(), &c, &to).await;
    // Flip one byte in the middle of every large blob the registry stores.
    let blobs = d
        .path()
        .join("registry/storage/docker/registry/v2/blobs/sha256");
    let mut flipped = 0;
    for prefix in std::fs::read_dir(&blobs).unwrap() {
        for blob in std::fs::read_dir(prefix.unwrap().path()).unwrap() {
            let data = blob.unwrap().path().join("data");
            let len = std::fs::metadata(&data).unwrap().len();
            if len > 64 << 10 {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&data)
                    .unwrap();
                let mut byte = [0u8; 1];
                f.read_exact_at(&mut byte, len / 2).unwrap();
                f.write_all_at(&[byte[0] ^ 0xff], len / 2).unwrap();
                flipped += 1;
            }
        }
    }
    assert!(flipped > 0, "no large blob found in {}", blobs.display());
    let b = store(&d.path().join("b"));
    match twig_oci::pull(&c, &b, &to, Some(OWNER)).await {
        // The digest, or the blob's format where the flip hit a header.
        Err(Error::Corrupt(m)) => {
            assert!(m.contains("digest") || m.contains("extents blob"), "{m}")
        }
        other => panic!("a corrupted blob was accepted: {other:?}"),
    }
    assert_clean(&b);
}

/// A TCP proxy that forwards until `budget` bytes of answers went through,
/// then cuts every connection: a registry dying mid-transfer.
async fn cutting_proxy(upstream: String, budget: u64) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let left = Arc::new(AtomicU64::new(budget));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(&upstream).await else {
                return;
            };
            let left = left.clone();
            tokio::spawn(async move {
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let up = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut cr, &mut sw).await;
                });
                let mut buf = vec![0u8; 16 << 10];
                loop {
                    let n = match sr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let allowed = left.fetch_sub(n as u64, Ordering::SeqCst).min(n as u64) as usize;
                    if allowed < n {
                        let _ = cw.write_all(&buf[..allowed]).await;
                        left.store(0, Ordering::SeqCst);
                        break;
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                up.abort();
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_gone_mid_pull_leaves_the_store_clean() {
    let d = tempfile::tempdir().unwrap();
    let registry = Registry::start(&d.path().join("registry")).expect("docker-registry");
    let c = client(&registry.host());
    let to = reference(&registry.host(), "v1");
    pushed_full(d.path(), &c, &to).await;

    let proxy = cutting_proxy(registry.host(), 128 << 10).await;
    let via = Reference::parse(&to.to_string().replace(&registry.host(), &proxy)).unwrap();
    let b = store(&d.path().join("b"));
    match twig_oci::pull(&client(&proxy), &b, &via, Some(OWNER)).await {
        Err(Error::Transfer(_) | Error::Unreachable(_) | Error::Corrupt(_)) => {}
        other => panic!("a cut transfer was not an error: {other:?}"),
    }
    assert_clean(&b);

    // Stopped altogether: a clear error, the store still clean.
    let host = registry.host();
    drop(registry);
    match twig_oci::pull(&c, &b, &to, Some(OWNER)).await {
        Err(Error::Unreachable(m)) => assert!(m.contains(&host), "{m}"),
        other => panic!("an unreachable registry was not reported: {other:?}"),
    }
    assert_clean(&b);
}

/// Unmounts a filesystem mounted by a test, also when it fails.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_during_a_pull_is_no_space_and_leaves_nothing() {
    let d = tempfile::tempdir().unwrap();
    let registry = Registry::start(&d.path().join("registry")).expect("docker-registry");
    let c = client(&registry.host());
    let to = reference(&registry.host(), "v1");
    pushed_full(d.path(), &c, &to).await;
    // A node store on a filesystem with room for less than the snapshot
    // (its 1 MiB disk alone does not fit). Needs root.
    let small = d.path().join("small");
    std::fs::create_dir_all(&small).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=768k", "tmpfs"])
        .arg(&small)
        .status()
        .expect("mount(8)");
    assert!(
        ok.success(),
        "this test mounts a small tmpfs: run it as root"
    );
    let _mounted = Mounted(small.clone());
    let b = store(&small.join("store"));
    match twig_oci::pull(&c, &b, &to, Some(OWNER)).await {
        Err(Error::NoSpace(m)) => assert!(m.contains("No space"), "{m}"),
        Err(Error::Store(twig_store::Error::NoSpace { .. })) => {}
        other => panic!("a pull into a full store was not NoSpace: {other:?}"),
    }
    assert_clean(&b);
}
