//! Helpers shared by the registry tests: a ring-3 test guest with a disk,
//! its snapshots in node stores, a client of the test's registry.

#![allow(dead_code)]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use twig_oci::{Client, Credentials, Reference};
use twig_store::NodeStore;
use twig_vmm::testguest::{self, Command};
use twig_vmm::{Capture, DeviceConfig, DiskConfig, Kind, Shape, Vm};

pub const T: Duration = Duration::from_secs(20);
pub const MIB: usize = 64;
pub const DISK: usize = 1 << 20;
pub const OWNER: &str = "team-a";

pub struct Guest {
    pub vm: Vm,
    pub serial: Capture,
}

pub fn require_kvm() {
    if let Err(e) = twig_vmm::open_kvm() {
        panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
    }
}

pub fn disk(path: &Path) -> DeviceConfig {
    DeviceConfig {
        disks: vec![DiskConfig {
            path: path.to_path_buf(),
            read_only: false,
        }],
        ..Default::default()
    }
}

pub fn boot(dir: &Path, rw: &Path) -> Guest {
    boot_with(dir, rw, MIB)
}

/// A guest of `mib` MiB.
pub fn boot_with(dir: &Path, rw: &Path, mib: usize) -> Guest {
    require_kvm();
    let serial = Capture::new();
    let mut vm =
        Vm::create_with(Shape::new(mib, 1), serial.writer(), &disk(rw)).expect("create VM");
    let kernel = testguest::write_to(dir).expect("write guest");
    vm.boot(&kernel, "console=ttyS0").expect("boot");
    serial.wait_for(b"B", 0, T).expect("boot marker");
    testguest::wait_booted(&vm, T).expect("guest magic");
    Guest { vm, serial }
}

/// Page `first + i` of the scratch area holds `value + i`.
pub fn dirty(vm: &mut Vm, first: u64, pages: u64, value: u64) {
    testguest::run(
        vm,
        Command::Dirty,
        [testguest::SCRATCH + first * 4096, pages, value],
        T,
    )
    .expect("dirty");
}

pub fn word(vm: &Vm, page: u64) -> u64 {
    vm.read_u64(testguest::SCRATCH + page * 4096)
        .expect("read guest memory")
}

pub fn write_at(path: &Path, off: u64, data: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, off).unwrap();
}

/// Snapshots `vm` into `store` as `id`, owned by [`OWNER`].
pub fn take(vm: &mut Vm, store: &NodeStore, id: &str, kind: Kind) {
    let mut staging = store.stage(id).unwrap();
    vm.snapshot(staging.dir(), kind).unwrap();
    staging.set_owner(OWNER).unwrap();
    staging.publish().unwrap();
}

pub fn store(dir: &Path) -> NodeStore {
    // /tmp cannot reflink here: copies allowed.
    NodeStore::open(dir, true).unwrap()
}

/// Nothing published and nothing left staged.
pub fn assert_clean(store: &NodeStore) {
    assert!(
        store.list().unwrap().is_empty(),
        "{:?}",
        store.list().unwrap()
    );
    let tmp: Vec<_> = std::fs::read_dir(store.root().join("tmp"))
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(tmp.is_empty(), "left in tmp: {tmp:?}");
}

pub fn client(registry: &str) -> Client {
    Client::new(Credentials::default(), vec![registry.to_string()]).unwrap()
}

pub fn reference(host: &str, tag: &str) -> Reference {
    Reference::parse(&format!("{host}/twig/{OWNER}/agent:{tag}")).unwrap()
}

/// A full snapshot of a booted guest in a new store under `dir`, pushed.
pub async fn pushed_full(dir: &Path, c: &Client, to: &Reference) -> PathBuf {
    let a = store(&dir.join("a"));
    let rw = dir.join("rw.img");
    std::fs::write(&rw, vec![0x5au8; DISK]).unwrap();
    let mut g = boot(dir, &rw);
    dirty(&mut g.vm, 0, 64, 1);
    take(&mut g.vm, &a, "full", Kind::Full);
    twig_oci::push(c, &a, "full", to).await.unwrap();
    a.root().to_path_buf()
}

/// Where the test registry started in `registry_dir` keeps blob `digest`.
pub fn blob_path(registry_dir: &Path, digest: &str) -> PathBuf {
    let hex = digest.trim_start_matches("sha256:");
    registry_dir
        .join("storage/docker/registry/v2/blobs/sha256")
        .join(&hex[..2])
        .join(hex)
        .join("data")
}
