//! Lazy pulls through a real registry (Debian's `docker-registry`): a
//! snapshot chain staged without its memory, the leaf's guest memory read
//! page by page by verified range before the download has finished, then
//! published as an eager pull would; a tampered record, a registry gone
//! and another namespace refused, each leaving the store clean. Needs
//! /dev/kvm (the ring-3 test guest) and `docker-registry`.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::*;
use twig_cri::harness::Registry;
use twig_oci::artifact::OciManifest;
use twig_oci::extents::{Index, MAX_RECORD};
use twig_oci::{Client, Error, PageSource, Reference};
use twig_store::{Artefact, NodeStore};
use twig_vmm::snapshot::Image;
use twig_vmm::testguest::{self, Command};
use twig_vmm::{Capture, Kind, Shape, Vm};

const PAGE: u64 = 4096;
/// The first page of the test guest's scratch area.
const SCRATCH: u64 = testguest::SCRATCH / PAGE;

/// Pages `first..first + n` of `src`, read on a blocking thread.
async fn read(src: &Arc<PageSource>, first: u64, n: u64) -> twig_oci::Result<Vec<u8>> {
    let src = src.clone();
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; (n * PAGE) as usize];
        src.read(first, &mut buf).map(|()| buf)
    })
    .await
    .unwrap()
}

/// What a VM restored from snapshot `dir` (and its chain) has in pages
/// `first..first + n`: each page from the newest layer holding it
/// (twig-vmm's composition).
fn composed(image: &Arc<Image>, first: u64, n: u64) -> Vec<u8> {
    let mut out = vec![0u8; (n * PAGE) as usize];
    let root = image.chain()[0].clone();
    for (k, buf) in out.chunks_mut(PAGE as usize).enumerate() {
        let page = first + k as u64;
        let from = image
            .layer_for(page as usize)
            .unwrap_or_else(|| root.clone());
        from.memory.read_exact_at(buf, page * PAGE).unwrap();
    }
    out
}

fn word_of(page: &[u8]) -> u64 {
    u64::from_le_bytes(page[..8].try_into().unwrap())
}

/// The size of the memory blob of each snapshot of `r`'s chain.
async fn memory_blobs(c: &Client, r: &Reference) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut target = r.target().to_string();
    loop {
        let (bytes, _) = c.manifest(r, &target).await.unwrap();
        let (m, layers) = OciManifest::parse(&bytes).unwrap();
        let mem = layers
            .iter()
            .find(|l| l.artefact == Artefact::Memory)
            .unwrap();
        out.push((mem.blob.digest.clone(), mem.blob.size));
        match m.subject {
            Some(s) => target = s.digest,
            None => return out,
        }
    }
}

/// Every published snapshot of `s`: id, parent, kind, labels, owner,
/// artefacts, and each artefact's bytes.
type Published = Vec<(String, Option<String>, String, Vec<(Artefact, Vec<u8>)>)>;

fn published(s: &NodeStore) -> Published {
    let mut v: Published = s
        .list()
        .unwrap()
        .into_iter()
        .map(|x| {
            let files = x
                .artefacts
                .keys()
                .map(|a| (*a, std::fs::read(x.path(*a).unwrap()).unwrap()))
                .collect();
            let meta = format!(
                "{:?} {:?} {:?} {:?}",
                x.kind, x.labels, x.owner, x.artefacts
            );
            (x.id, x.parent, meta, files)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazily_pulled_chain_reads_as_its_composed_memory_and_finishes_as_an_eager_pull() {
    let d = tempfile::tempdir().unwrap();
    let registry = Registry::start(&d.path().join("registry")).expect("docker-registry");
    let c = client(&registry.host());
    let (a, b, e) = (
        store(&d.path().join("a")),
        store(&d.path().join("b")),
        store(&d.path().join("e")),
    );
    let rw = d.path().join("rw.img");
    std::fs::write(&rw, vec![0xa1u8; DISK]).unwrap();
    // A 128 MiB guest with 8 MiB of its memory written, then a few pages
    // more in an incremental snapshot.
    let mib = 128;
    let mut g = boot_with(d.path(), &rw, mib);
    dirty(&mut g.vm, 0, 2048, 100);
    take(&mut g.vm, &a, "base", Kind::Full);
    dirty(&mut g.vm, 0, 16, 200);
    dirty(&mut g.vm, 3000, 4, 900);
    write_at(&rw, 8192, b"incremental");
    take(&mut g.vm, &a, "inc", Kind::Incremental);
    let disk_at_inc = std::fs::read(&rw).unwrap();
    let v1 = reference(&registry.host(), "v1");
    let pushed = twig_oci::push(&c, &a, "inc", &v1).await.unwrap();
    let blobs = memory_blobs(&c, &v1).await;
    let memory_bytes: u64 = blobs.iter().map(|b| b.1).sum();
    assert!(memory_bytes > 8 << 20, "{blobs:?}");

    let lazy = twig_oci::pull_lazy(&c, &b, &v1, Some(OWNER)).await.unwrap();
    assert!(lazy.is_staged());
    assert_eq!(lazy.id, twig_oci::pulled_id(&pushed.digest));
    assert!(b.list().unwrap().is_empty(), "published before its memory");
    // Staged and described: what a lazy restore reads.
    let staged = b.staged(&lazy.dir).unwrap();
    assert_eq!(staged.id, lazy.id);
    assert!(staged.path(Artefact::Memory).is_none(), "{staged:?}");
    assert!(std::fs::read(lazy.dir.join("disk0")).unwrap() == disk_at_inc);
    twig_vmm::snapshot::read_state(&lazy.dir).unwrap();

    let src = lazy.source.clone();
    assert_eq!(src.mem_size(), (mib as u64) << 20);
    assert_eq!(src.pages(), (mib as u64) << 8);
    let image = Image::open(&a.snapshot_dir("inc")).unwrap();
    // A few pages: only their records travel.
    for (page, want) in [(SCRATCH, 200), (SCRATCH + 20, 120), (SCRATCH + 3001, 901)] {
        let got = read(&src, page, 1).await.unwrap();
        assert_eq!(word_of(&got), want, "page {page}");
        assert!(got == composed(&image, page, 1), "page {page}");
    }
    let few = src.bytes_fetched();
    assert!(
        few > 0 && few <= 3 * MAX_RECORD,
        "three pages fetched {few} bytes of {memory_bytes}"
    );
    assert_eq!(src.served(), vec![SCRATCH, SCRATCH + 20, SCRATCH + 3001]);
    // Fetched once: read again, nothing moves.
    read(&src, SCRATCH, 1).await.unwrap();
    src.prefetch(&[SCRATCH + 20]).unwrap();
    assert_eq!(src.bytes_fetched(), few);
    // A page the guest never touched is known zero, and reads so.
    let last = src.pages() - 1;
    assert!(src.is_zero(last));
    assert!(read(&src, last, 1).await.unwrap().iter().all(|b| *b == 0));
    assert!(!src.is_zero(SCRATCH));
    // Prefetching the next records fetches them ahead.
    let ahead = SCRATCH + 1024;
    src.prefetch(&[ahead]).unwrap();
    let prefetched = src.bytes_fetched();
    assert!(prefetched > few, "{prefetched}");
    read(&src, ahead, 1).await.unwrap();
    assert_eq!(src.bytes_fetched(), prefetched);

    // Every page, before the download, while a prefetch of them all runs:
    // the composed memory of A's chain, each record fetched once (a read
    // of a record being prefetched waits for it).
    let everything: Vec<u64> = (0..src.pages()).collect();
    let prefetch = {
        let src = src.clone();
        tokio::task::spawn_blocking(move || src.prefetch(&everything))
    };
    let chunk = 1024;
    for first in (0..src.pages()).step_by(chunk as usize) {
        let got = read(&src, first, chunk).await.unwrap();
        assert!(
            got == composed(&image, first, chunk),
            "pages {first}+{chunk} differ"
        );
    }
    prefetch.await.unwrap().unwrap();
    let all = src.bytes_fetched();
    assert!(all <= memory_bytes, "{all} fetched for {memory_bytes}");
    assert!(b.list().unwrap().is_empty());

    // On a task of its own, as a node runs it while serving faults.
    let pulled = tokio::spawn(lazy.finish()).await.unwrap().unwrap();
    assert_eq!(
        (
            pulled.id.as_str(),
            pulled.snapshots_pulled,
            pulled.digest.as_str()
        ),
        (
            twig_oci::pulled_id(&pushed.digest).as_str(),
            2,
            pushed.digest.as_str()
        )
    );
    // The same store as an eager pull makes.
    let eager = twig_oci::pull(&c, &e, &v1, Some(OWNER)).await.unwrap();
    assert_eq!(eager.id, pulled.id);
    assert!(
        published(&b) == published(&e),
        "lazy and eager pulls differ"
    );
    let tmp: Vec<_> = std::fs::read_dir(b.root().join("tmp")).unwrap().collect();
    assert!(tmp.is_empty(), "left in tmp: {tmp:?}");
    // Served from the files now: nothing more fetched.
    let got = read(&src, SCRATCH, 16).await.unwrap();
    assert!(got == composed(&image, SCRATCH, 16));
    assert_eq!(src.bytes_fetched(), all);

    // And the published snapshot restores.
    let rw2 = d.path().join("rw2.img");
    std::fs::write(&rw2, b"").unwrap();
    let serial = Capture::new();
    let mut r = Vm::create_with(Shape::new(mib, 1), serial.writer(), &disk(&rw2)).unwrap();
    r.restore(&b.snapshot_dir(&pulled.id)).unwrap();
    assert_eq!((word(&r, 0), word(&r, 20), word(&r, 3001)), (200, 120, 901));
    assert!(std::fs::read(&rw2).unwrap() == disk_at_inc);
    let from = serial.bytes().len();
    testguest::run(&mut r, Command::Print, [b'l' as u64, 0, 0], T).unwrap();
    serial.wait_for(b"l", from, T).unwrap();
    // A child on top of what the store has: its own layer by range, the
    // rest from the store's files.
    dirty(&mut g.vm, 8, 4, 700);
    take(&mut g.vm, &a, "inc2", Kind::Incremental);
    let v2 = reference(&registry.host(), "v2");
    twig_oci::push(&c, &a, "inc2", &v2).await.unwrap();
    let child = twig_oci::pull_lazy(&c, &b, &v2, Some(OWNER)).await.unwrap();
    assert!(child.is_staged());
    let image2 = Image::open(&a.snapshot_dir("inc2")).unwrap();
    for first in (0..child.source.pages()).step_by(chunk as usize) {
        let got = read(&child.source, first, chunk).await.unwrap();
        assert!(
            got == composed(&image2, first, chunk),
            "child pages {first}+{chunk} differ"
        );
    }
    let got = read(&child.source, SCRATCH + 8, 1).await.unwrap();
    assert_eq!(word_of(&got), 700);
    assert!(
        child.source.bytes_fetched() <= MAX_RECORD,
        "{}",
        child.source.bytes_fetched()
    );
    let next = child.finish().await.unwrap();
    assert_eq!(next.snapshots_pulled, 1, "{next:?}");
    assert_eq!(b.get(&next.id).unwrap().parent, Some(pulled.id.clone()));

    // Pulled again lazily: nothing staged, the store's own.
    let again = twig_oci::pull_lazy(&c, &b, &v1, Some(OWNER)).await.unwrap();
    assert!(!again.is_staged());
    assert_eq!(again.dir, b.snapshot_dir(&pulled.id));
    let got = read(&again.source, SCRATCH, 4).await.unwrap();
    assert!(got == composed(&image, SCRATCH, 4));
    assert_eq!(again.source.bytes_fetched(), 0);
    assert_eq!(again.finish().await.unwrap().snapshots_pulled, 0);
}

/// The index of the extents blob at `path` (what the push wrote).
fn index_on_disk(path: &Path, length: u64) -> Index {
    let blob = std::fs::read(path).unwrap();
    let foot = &blob[blob.len() - 24..];
    let at = u64::from_le_bytes(foot[8..16].try_into().unwrap());
    Index::parse(&blob[at as usize..], at, blob.len() as u64, length).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_record_is_refused_by_read_and_finish_and_nothing_is_published() {
    let d = tempfile::tempdir().unwrap();
    let registry = Registry::start(&d.path().join("registry")).expect("docker-registry");
    let c = client(&registry.host());
    let to = reference(&registry.host(), "v1");
    pushed_full(d.path(), &c, &to).await;
    let (digest, _) = memory_blobs(&c, &to).await.remove(0);
    // One byte of the record holding the scratch area's first page.
    let path = blob_path(&d.path().join("registry"), &digest);
    let index = index_on_disk(&path, (MIB as u64) << 20);
    let i = index.find(SCRATCH * PAGE).unwrap();
    let e = index.entries[i];
    let at = e.data_range().0 + (SCRATCH * PAGE - e.offset) + 8;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut byte = [0u8; 1];
    f.read_exact_at(&mut byte, at).unwrap();
    f.write_all_at(&[byte[0] ^ 0xff], at).unwrap();
    let other = index
        .entries
        .iter()
        .position(|x| x.offset / PAGE < SCRATCH - 64);
    let other = index.entries[other.expect("a record below the scratch area")];

    let b = store(&d.path().join("b"));
    let lazy = twig_oci::pull_lazy(&c, &b, &to, Some(OWNER)).await.unwrap();
    match read(&lazy.source, SCRATCH, 1).await {
        Err(Error::Corrupt(m)) => assert!(m.contains(&digest), "{m}"),
        other => panic!("a tampered record was served: {other:?}"),
    }
    // Other records are still served.
    read(&lazy.source, other.offset / PAGE, 1).await.unwrap();
    match lazy.finish().await {
        Err(Error::Corrupt(m)) => assert!(m.contains("index") || m.contains("digest"), "{m}"),
        other => panic!("a tampered blob was published: {other:?}"),
    }
    assert_clean(&b);
}

/// A full snapshot of the test guest pushed to a registry of its own, and
/// an empty store to pull it into.
struct Pushed {
    /// Holds the registry's and the stores' files.
    _dir: tempfile::TempDir,
    registry: Registry,
    c: Client,
    to: Reference,
    /// The pushing store's directory.
    a: PathBuf,
    b: NodeStore,
}

async fn pushed() -> Pushed {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::start(&dir.path().join("registry")).expect("docker-registry");
    let c = client(&registry.host());
    let to = reference(&registry.host(), "v1");
    let a = pushed_full(dir.path(), &c, &to).await;
    let b = store(&dir.path().join("b"));
    Pushed {
        _dir: dir,
        registry,
        c,
        to,
        a,
        b,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_gone_under_a_lazy_pull_is_an_error_not_a_hang() {
    let Pushed {
        _dir,
        registry,
        c,
        to,
        b,
        ..
    } = pushed().await;
    let lazy = twig_oci::pull_lazy(&c, &b, &to, Some(OWNER)).await.unwrap();
    let host = registry.host();
    drop(registry);
    let read = tokio::time::timeout(T, read(&lazy.source, SCRATCH, 1)).await;
    match read {
        Ok(Err(Error::Unreachable(m))) => assert!(m.contains(&host), "{m}"),
        Ok(other) => panic!("a page of a stopped registry: {other:?}"),
        Err(_) => panic!("a read from a stopped registry hung for {T:?}"),
    }
    match tokio::time::timeout(T, lazy.finish()).await {
        Ok(Err(Error::Unreachable(_) | Error::Transfer(_))) => {}
        Ok(other) => panic!("a lazy pull finished without its registry: {other:?}"),
        Err(_) => panic!("finishing without a registry hung for {T:?}"),
    }
    assert_clean(&b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_namespace_is_refused_and_a_lazy_pull_as_reads_while_it_downloads() {
    let Pushed {
        _dir,
        registry: _registry,
        c,
        to,
        a,
        b,
    } = pushed().await;
    match twig_oci::pull_lazy(&c, &b, &to, Some("team-b")).await {
        Err(Error::PermissionDenied(m)) => assert!(m.contains("team-a"), "{m}"),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("another namespace pulled it lazily"),
    }
    assert_clean(&b);
    assert!(matches!(
        twig_oci::lazy::pull_lazy_as(&c, &b, &to, Some(OWNER), "../x").await,
        Err(Error::Store(_))
    ));
    // Under an id of the caller's choosing.
    let named = twig_oci::lazy::pull_lazy_as(&c, &b, &to, Some(OWNER), "template.team-a.x")
        .await
        .unwrap();
    assert_eq!(named.id, "template.team-a.x");
    // Read while the download runs: each page by range or from what has
    // been written, the same either way.
    let src = named.source.clone();
    let finishing = tokio::spawn(named.finish());
    let image = Image::open(&a.join("snapshots/full")).unwrap();
    let chunk = 256;
    for first in (0..src.pages()).step_by(chunk as usize) {
        let got = read(&src, first, chunk).await.unwrap();
        assert!(
            got == composed(&image, first, chunk),
            "pages {first}+{chunk}"
        );
    }
    let pulled = finishing.await.unwrap().unwrap();
    assert_eq!(b.get(&pulled.id).unwrap().owner.as_deref(), Some(OWNER));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_download_keeps_its_pace_while_pages_are_read_at_once() {
    let Pushed {
        _dir,
        registry: _registry,
        c,
        to,
        a,
        b,
    } = pushed().await;
    let size = memory_blobs(&c, &to).await[0].1;
    let lazy = twig_oci::pull_lazy(&c, &b, &to, Some(OWNER)).await.unwrap();
    // Paced to take 4 s for the memory blob.
    const SECS: u64 = 4;
    let pace = std::num::NonZeroU64::new(size.div_ceil(SECS)).unwrap();
    let src = lazy.source.clone();
    let started = std::time::Instant::now();
    let finishing = tokio::spawn(lazy.finish_paced(Some(pace)));
    // A page is read by range, not after the paced download.
    let image = Image::open(&a.join("snapshots/full")).unwrap();
    let got = read(&src, SCRATCH, 1).await.unwrap();
    assert!(got == composed(&image, SCRATCH, 1), "page {SCRATCH}");
    assert!(
        !finishing.is_finished(),
        "the paced download ended before a page read by range ({:?})",
        started.elapsed()
    );
    let pulled = finishing.await.unwrap().unwrap();
    let took = started.elapsed();
    assert!(
        took >= std::time::Duration::from_secs(SECS) - std::time::Duration::from_millis(50),
        "{size} bytes at {pace} bytes/s arrived in {took:?}"
    );
    assert_eq!(b.get(&pulled.id).unwrap().owner.as_deref(), Some(OWNER));
    assert!(pulled.bytes_downloaded >= size, "{pulled:?}");
}

/// A registry that answers every blob GET with `status` and `body`.
async fn canned(status: &'static str, body: &'static [u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let head = format!(
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(body).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_answered_whole_or_short_is_an_error() {
    let digest = format!("sha256:{}", "0".repeat(64));
    let whole = canned("200 OK", b"0123456789").await;
    let r = Reference::parse(&format!("{whole}/twig/team-a/agent:v1")).unwrap();
    match client(&whole).blob_range(&r, &digest, 2, 4).await {
        Err(Error::Registry(m)) => assert!(m.contains("200"), "{m}"),
        other => panic!("a whole blob was taken for a range: {other:?}"),
    }
    let short = canned("206 Partial Content", b"012").await;
    let r = Reference::parse(&format!("{short}/twig/team-a/agent:v1")).unwrap();
    match client(&short).blob_range(&r, &digest, 2, 4).await {
        Err(Error::Transfer(m)) => assert!(m.contains("3 bytes"), "{m}"),
        other => panic!("a short range was taken: {other:?}"),
    }
    let exact = canned("206 Partial Content", b"2345").await;
    let r = Reference::parse(&format!("{exact}/twig/team-a/agent:v1")).unwrap();
    let got = client(&exact).blob_range(&r, &digest, 2, 4).await.unwrap();
    assert_eq!(&got[..], b"2345");
}
