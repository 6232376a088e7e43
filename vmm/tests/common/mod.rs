//! Shared helpers for the integration tests. They run on the real /dev/kvm
//! and fail (never skip) with a clear message when it is unavailable.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use twig_store::NodeStore;
use twig_vmm::testguest::{self, Command};
use twig_vmm::{Capture, DeviceConfig, Kind, Shape, SnapshotInfo, Vm};

/// A deadline for hangs, not a measure of speed: in the lab (emulated CPUs,
/// both lanes running) a guest command of a few thousand pages has taken
/// over 20 s.
pub const T: Duration = Duration::from_secs(60);
pub const MIB: usize = 64;

/// Fails the test with a clear message if /dev/kvm cannot be used.
pub fn require_kvm() {
    if let Err(e) = twig_vmm::open_kvm() {
        panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
    }
}

pub struct Guest {
    pub vm: Vm,
    pub serial: Capture,
}

/// Boots the test guest and waits for its boot marker.
pub fn boot(dir: &std::path::Path, mib: usize, vcpus: usize) -> Guest {
    boot_with(dir, mib, vcpus, &DeviceConfig::default())
}

/// Boots the test guest with `devices` and waits for its boot marker.
pub fn boot_with(dir: &std::path::Path, mib: usize, vcpus: usize, devices: &DeviceConfig) -> Guest {
    require_kvm();
    let serial = Capture::new();
    let mut vm =
        Vm::create_with(Shape::new(mib, vcpus), serial.writer(), devices).expect("create VM");
    let kernel = testguest::write_to(dir).expect("write guest");
    vm.boot(&kernel, "console=ttyS0").expect("boot");
    serial.wait_for(b"B", 0, T).expect("boot marker");
    testguest::wait_booted(&vm, T).expect("guest magic");
    Guest { vm, serial }
}

pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// The directory of snapshot `id` in the node store `<dir>/store`.
pub fn snap(dir: &Path, id: &str) -> PathBuf {
    dir.join("store/snapshots").join(id)
}

/// The node store a snapshot directory `<store>/snapshots/<id>` belongs
/// to (opened, created if needed; copies allowed, as /tmp cannot reflink),
/// and the id.
pub fn store_of(dir: &Path) -> (NodeStore, String) {
    let (root, id) = twig_store::layout::locate(dir).expect("a snapshot directory of a store");
    (
        NodeStore::open(&root, true).expect("open the node store"),
        id,
    )
}

/// Snapshots `vm` into the node store as the snapshot directory `dir`
/// (`<store>/snapshots/<id>`), published.
pub fn take(vm: &mut Vm, dir: &Path, kind: Kind) -> twig_vmm::Result<SnapshotInfo> {
    let (store, id) = store_of(dir);
    vm.snapshot_into(&store, &id, kind)
}

/// Dirties `pages` pages from the scratch area, page i holding `value + i`.
pub fn dirty(vm: &mut Vm, first_page: u64, pages: u64, value: u64) {
    testguest::run(
        vm,
        Command::Dirty,
        [testguest::SCRATCH + first_page * 4096, pages, value],
        T,
    )
    .expect("dirty command");
}

/// The first word of scratch page `p`.
pub fn word(vm: &Vm, p: u64) -> u64 {
    vm.read_u64(testguest::SCRATCH + p * 4096).expect("read")
}

pub fn print(vm: &mut Vm, serial: &Capture, byte: u8) {
    let from = serial.bytes().len();
    testguest::run(vm, Command::Print, [byte as u64, 0, 0], T).expect("print");
    serial.wait_for(&[byte], from, T).expect("printed byte");
}

/// A tap named `name` opened as a caller of `attach_net` opens one
/// (`IFF_TAP|IFF_NO_PI|IFF_VNET_HDR`), created in the caller's network
/// namespace; it goes away when the last descriptor is closed.
pub fn open_tap(name: &str) -> std::fs::File {
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        flags: libc::c_short,
        pad: [u8; 22],
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .expect("open /dev/net/tun");
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short,
        pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes an ifreq, which IfReq lays out.
    let r = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            libc::TUNSETIFF,
            &mut req,
        )
    };
    assert_eq!(
        r,
        0,
        "TUNSETIFF {name}: {}",
        std::io::Error::last_os_error()
    );
    file
}

/// Whether the interface `name` exists in this network namespace.
pub fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}
