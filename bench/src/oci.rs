//! Snapshots across nodes through an OCI registry (twig-oci), on the host:
//! twig-vmm's ring-3 test guest with a working set of a given share of its
//! memory, snapshotted full and then incrementally into one node store,
//! pushed to a real `docker-registry` (started and stopped here), pulled
//! into a fresh store (another node's), and restored there; against a
//! restore from the source store (a clone on the same node). Reports bytes
//! moved for full and incremental snapshots, push and pull times, and
//! restore → first answer of the guest, per guest size; and a clone on a
//! node that has nothing of the chain, from the pull's start to the
//! guest's first answer: eager (pull the chain, restore) against lazy
//! (twig-oci's lazy pull, twig-node's page server, twig-vmm's lazy
//! restore: the guest answers while its memory arrives), with the
//! snapshot's hot list sent first and without it (faults alone); and, for
//! the same three, until the guest has rewritten its whole working set
//! (every page of it back in memory).

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use twig_cri::harness::Registry;
use twig_oci::{Client, Credentials, Reference};
use twig_store::NodeStore;
use twig_vmm::testguest::{self, Command};
use twig_vmm::{Capture, Kind, Shape, Vm};

use crate::stats::{Context, Error, Report};

const T: Duration = Duration::from_secs(120);

#[derive(clap::Args)]
pub struct Args {
    /// Guest memory sizes, MiB.
    #[arg(long, value_delimiter = ',', default_value = "128,512,1024,2048")]
    sizes: Vec<usize>,
    /// Share of guest memory above the guest's own 16 MiB that it has
    /// written before the full snapshot (its working set), percent.
    #[arg(long, default_value_t = 25)]
    touched_pct: u64,
    /// Pages the guest writes between the full and the incremental snapshot.
    #[arg(long, default_value_t = 1000)]
    delta_pages: u64,
    /// Repetitions per size (each into a new repository and a new store).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Where the stores and the registry live (default: a temporary
    /// directory under /tmp).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

pub fn run(args: &Args) -> Result<Value, Error> {
    twig_vmm::open_kvm().context(|| "this benchmark needs /dev/kvm".into())?;
    let tmp = match &args.dir {
        Some(d) => tempfile::tempdir_in(d)?,
        None => tempfile::tempdir()?,
    };
    let registry = Registry::start(&tmp.path().join("registry"))?;
    let client = Client::new(Credentials::default(), vec![registry.host()])?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut report = Report::default();
    let mut sizes = Vec::new();
    for &mib in &args.sizes {
        eprintln!("-- {mib} MiB guest, {}% touched", args.touched_pct);
        let one = rt.block_on(size_run(
            args,
            mib,
            tmp.path(),
            &registry,
            &client,
            &mut report,
        ))?;
        sizes.push(one);
    }
    report.insert("sizes", Value::Array(sizes));
    report.insert("touched_pct", json!(args.touched_pct));
    report.insert("delta_pages", json!(args.delta_pages));
    Ok(report.into_value())
}

fn boot(mib: usize, dir: &Path) -> Result<Vm, Error> {
    let serial = Capture::new();
    let mut vm = Vm::create(Shape::new(mib, 1), serial.writer())?;
    vm.boot(&testguest::write_to(dir)?, "console=ttyS0")?;
    testguest::wait_booted(&vm, T)?;
    Ok(vm)
}

fn dirty(vm: &mut Vm, first_page: u64, pages: u64, value: u64) -> Result<(), Error> {
    testguest::run(
        vm,
        Command::Dirty,
        [testguest::SCRATCH + first_page * 4096, pages, value],
        T,
    )?;
    Ok(())
}

/// A new VM restored from `dir`, until the guest has answered a command.
fn restore_to_answer(mib: usize, dir: &Path) -> Result<Duration, Error> {
    let t = Instant::now();
    let mut vm = Vm::create(Shape::new(mib, 1), Box::new(std::io::sink()))?;
    vm.restore(dir)?;
    dirty(&mut vm, 0, 1, 9)?;
    Ok(t.elapsed())
}

/// Times from `t` until a restored guest has answered a command and,
/// after that, until it has rewritten the first `working` pages of its
/// scratch memory (its working set).
fn answer_and_working_set(
    vm: &mut Vm,
    t: Instant,
    working: u64,
) -> Result<(Duration, Duration), Error> {
    dirty(vm, 0, 1, 9)?;
    let answer = t.elapsed();
    dirty(vm, 0, working, 3)?;
    Ok((answer, t.elapsed()))
}

/// What a clone on a node with nothing of the chain took, from the pull's
/// start.
struct Elsewhere {
    answer: Duration,
    working_set: Duration,
    /// Bytes fetched by range before the answer (lazy restores).
    fetched: u64,
}

/// An eager clone from `from` into `store`: the whole chain pulled, then
/// restored.
async fn eager_elsewhere(
    client: &Client,
    store: &NodeStore,
    from: &Reference,
    mib: usize,
    working: u64,
) -> Result<Elsewhere, Error> {
    let t = Instant::now();
    let got = twig_oci::pull(client, store, from, None).await?;
    let mut vm = Vm::create(Shape::new(mib, 1), Box::new(std::io::sink()))?;
    vm.restore(&store.snapshot_dir(&got.id))?;
    let (answer, working_set) = answer_and_working_set(&mut vm, t, working)?;
    Ok(Elsewhere {
        answer,
        working_set,
        fetched: 0,
    })
}

/// A VM restored lazily from `from` pulled into `store` (nothing of it
/// there), from the pull's start until the guest has answered a command
/// and rewritten its working set; then waits until the pull is published
/// and the VM's memory complete. Without `hot`, the page server is not
/// given the snapshot's hot list.
async fn lazy_elsewhere(
    client: &Client,
    store: &NodeStore,
    from: &Reference,
    (mib, working): (usize, u64),
    dir: &Path,
    hot: bool,
) -> Result<Elsewhere, Error> {
    let t = Instant::now();
    let mut pull = twig_oci::pull_lazy(client, store, from, None).await?;
    if !hot {
        pull.hot.clear();
    }
    let (staged, id, source) = (pull.dir.clone(), pull.id.clone(), pull.source.clone());
    let socket =
        twig_node::lazy::serve(dir, "bench", pull, None, tokio::runtime::Handle::current())
            .map_err(|e| Error::from(format!("starting the page server: {e}")))?;
    let (fetched, answer, working_set, vm) =
        tokio::task::block_in_place(|| -> Result<_, Error> {
            let uffd = std::fs::File::options()
                .read(true)
                .write(true)
                .open("/dev/userfaultfd")
                .context(|| "lazy restores need /dev/userfaultfd".into())?;
            let lazy = twig_vmm::LazySource::open(&staged, &uffd, UnixStream::connect(&socket)?)?;
            let mut vm = Vm::create(Shape::new(mib, 1), Box::new(std::io::sink()))?;
            vm.restore_lazy(lazy, &BTreeMap::new())?;
            vm.resume()?;
            dirty(&mut vm, 0, 1, 9)?;
            let (answer, fetched) = (t.elapsed(), source.bytes_fetched());
            dirty(&mut vm, 0, working, 3)?;
            Ok((fetched, answer, t.elapsed(), vm))
        })?;
    let deadline = Instant::now() + T;
    while vm.lazy_pending() || store.get(&id).is_err() {
        if Instant::now() > deadline {
            return Err(Error::from(format!(
                "the lazy restore of {id} did not complete within {T:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(Elsewhere {
        answer,
        working_set,
        fetched,
    })
}

async fn size_run(
    args: &Args,
    mib: usize,
    root: &Path,
    registry: &Registry,
    client: &Client,
    report: &mut Report,
) -> Result<Value, Error> {
    let dir = root.join(format!("{mib}"));
    std::fs::create_dir_all(&dir)?;
    let a = NodeStore::open(&dir.join("a"), true)?;
    let mut vm = boot(mib, &dir)?;
    let scratch_pages = ((mib as u64) << 8).saturating_sub(testguest::SCRATCH / 4096);
    let touched = scratch_pages * args.touched_pct / 100;
    dirty(&mut vm, 0, touched, 1)?;
    vm.snapshot_into(&a, "full", Kind::Full)?;
    dirty(&mut vm, 0, args.delta_pages.min(scratch_pages), 2)?;
    vm.snapshot_into(&a, "inc", Kind::Incremental)?;
    drop(vm);
    let sizes = a.sizes_of("full")?;
    let hot_pages: u64 = twig_vmm::snapshot::read_state(&a.snapshot_dir("inc"))?
        .meta
        .hot
        .iter()
        .map(|(_, n)| n)
        .sum();

    let (mut push_full, mut push_inc, mut pull, mut pull_inc) = (vec![], vec![], vec![], vec![]);
    let (mut remote, mut local) = (vec![], vec![]);
    // Per way of cloning elsewhere: first answers, working sets back,
    // bytes fetched before the answer (the last run's).
    let mut elsewhere: [(Vec<Duration>, Vec<Duration>, u64); 3] = Default::default();
    let (mut bytes_full, mut bytes_inc, mut bytes_pulled) = (0, 0, 0);
    for run in 0..args.runs {
        // A new repository each run: the registry keeps blobs per repository.
        let repo = |tag: &str| {
            Reference::parse(&format!(
                "{}/bench/m{mib}r{run}/agent:{tag}",
                registry.host()
            ))
        };
        let t = Instant::now();
        // The full snapshot alone first, then its child (only its delta).
        let pushed = twig_oci::push(client, &a, "full", &repo("full")?).await?;
        push_full.push(t.elapsed());
        bytes_full = pushed.bytes_uploaded;
        let t = Instant::now();
        let pushed = twig_oci::push(client, &a, "inc", &repo("inc")?).await?;
        push_inc.push(t.elapsed());
        bytes_inc = pushed.bytes_uploaded;

        let b = NodeStore::open(&dir.join(format!("b{run}")), true)?;
        let t = Instant::now();
        let got = twig_oci::pull(client, &b, &repo("full")?, None).await?;
        pull.push(t.elapsed());
        bytes_pulled = got.bytes_downloaded;
        let t = Instant::now();
        let inc = twig_oci::pull(client, &b, &repo("inc")?, None).await?;
        pull_inc.push(t.elapsed());
        remote.push(restore_to_answer(mib, &b.snapshot_dir(&inc.id))?);
        local.push(restore_to_answer(mib, &a.snapshot_dir("inc"))?);
        drop(b);
        std::fs::remove_dir_all(dir.join(format!("b{run}")))?;

        // A node with nothing of the chain: eager, then lazy with the hot
        // list and without.
        let c = NodeStore::open(&dir.join(format!("c{run}")), true)?;
        let d = NodeStore::open(&dir.join(format!("d{run}")), true)?;
        let e = NodeStore::open(&dir.join(format!("e{run}")), true)?;
        let from = repo("inc")?;
        let got = [
            eager_elsewhere(client, &c, &from, mib, touched).await?,
            lazy_elsewhere(client, &d, &from, (mib, touched), &dir, true).await?,
            lazy_elsewhere(client, &e, &from, (mib, touched), &dir, false).await?,
        ];
        for (way, one) in elsewhere.iter_mut().zip(got) {
            way.0.push(one.answer);
            way.1.push(one.working_set);
            way.2 = one.fetched;
        }
        drop((c, d, e));
        for store in ["c", "d", "e"] {
            std::fs::remove_dir_all(dir.join(format!("{store}{run}")))?;
        }
    }
    let key = |k: &str| format!("{k}_{mib}mib");
    report.timing(&key("push_full"), &push_full);
    report.timing(&key("push_incremental"), &push_inc);
    report.timing(&key("pull_full"), &pull);
    report.timing(&key("pull_incremental"), &pull_inc);
    report.timing(&key("restore_pulled_answer"), &remote);
    report.timing(&key("restore_local_answer"), &local);
    for (way, (answer, working_set, fetched)) in
        ["eager", "lazy", "lazy_nohot"].iter().zip(&elsewhere)
    {
        report.timing(&key(&format!("clone_elsewhere_{way}_answer")), answer);
        report.timing(
            &key(&format!("clone_elsewhere_{way}_working_set")),
            working_set,
        );
        if *way != "eager" {
            report.value(&key(&format!("{way}_bytes_before_answer")), json!(fetched));
        }
    }
    report.value(&key("bytes_full"), json!(bytes_full));
    report.value(&key("bytes_incremental"), json!(bytes_inc));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({
        "mib": mib,
        "memory_bytes": sizes.memory_bytes,
        "touched_pages": touched,
        "hot_pages": hot_pages,
        "bytes_pushed_full": bytes_full,
        "bytes_pushed_incremental": bytes_inc,
        "bytes_pulled_full": bytes_pulled,
    }))
}
