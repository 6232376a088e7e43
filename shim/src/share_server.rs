//! The file-share server: the twig-shim binary run as
//! `containerd-shim-twig-v2 `[`SERVE_ARG`]` <dir> <uid> <gid> <groups> <caps> <ro|rw>`
//! by [`crate::resources::share`], one process per shared volume, serving
//! host directory `<dir>` over 9P2000.L (the `p9` crate, crosvm's server) on
//! its standard input and output: the guest's file-share connection.
//!
//! The guest is hostile, so the server is jailed before it reads a byte:
//! - a mount namespace of its own, where `<dir>` is bound onto itself
//!   `nosuid,nodev` (no device node on the volume opens; no setuid
//!   program runs from it) and read-only for a read-only volume — the
//!   kernel refuses writes whatever the guest sends;
//! - `chroot` into it: no walk (`..`, a symlink — the server never follows
//!   one) leaves the volume;
//! - the container's identity: its uid, gid and groups, and of its
//!   effective capabilities only the file ones ([`FILE_CAPS`]: chown,
//!   dac_override, fowner, fsetid), in every set including the bounding
//!   set, with `no_new_privs`: what runc's container process has over a
//!   bind mount, less everything that could leave the chroot
//!   (sys_chroot, sys_admin, dac_read_search's open_by_handle_at, mknod).
//!   Files the guest creates belong to the container's user, as under runc.

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufReader, BufWriter, ErrorKind};
use std::os::fd::AsFd;
use std::path::PathBuf;

use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::unistd::{chdir, chroot, setgid, setgroups, setuid, Gid, Uid};
use twig_agent::caps::{self, CapSets};

/// The first argument that makes the shim binary a file-share server.
pub const SERVE_ARG: &str = "__twig-serve-share";

/// The capabilities a server may keep (bit masks by capability number):
/// CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID.
pub const FILE_CAPS: u64 = 1 << 0 | 1 << 1 | 1 << 3 | 1 << 4;

/// What one server serves, and as whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeArgs {
    /// The host directory.
    pub dir: PathBuf,
    /// The container's uid.
    pub uid: u32,
    /// The container's gid.
    pub gid: u32,
    /// Its supplementary groups.
    pub groups: Vec<u32>,
    /// Its capabilities (masked with [`FILE_CAPS`]).
    pub caps: u64,
    /// Refuse writes.
    pub read_only: bool,
}

impl ServeArgs {
    /// The arguments after [`SERVE_ARG`].
    pub fn to_args(&self) -> Vec<OsString> {
        let groups: Vec<String> = self.groups.iter().map(u32::to_string).collect();
        vec![
            self.dir.clone().into_os_string(),
            self.uid.to_string().into(),
            self.gid.to_string().into(),
            if groups.is_empty() {
                "-".into()
            } else {
                groups.join(",").into()
            },
            format!("{:#x}", self.caps & FILE_CAPS).into(),
            if self.read_only { "ro" } else { "rw" }.into(),
        ]
    }

    /// Parses the arguments after [`SERVE_ARG`].
    pub fn parse(args: &[OsString]) -> Result<ServeArgs, String> {
        let [dir, uid, gid, groups, caps, mode] = args else {
            return Err(format!("want 6 arguments, got {}", args.len()));
        };
        let text = |a: &OsString| a.to_str().map(str::to_string).ok_or("not UTF-8");
        let num = |a: &OsString| -> Result<u32, String> {
            text(a)?.parse().map_err(|e| format!("{a:?}: {e}"))
        };
        let groups = match text(groups)?.as_str() {
            "-" => Vec::new(),
            g => g
                .split(',')
                .map(|n| n.parse().map_err(|e| format!("group {n:?}: {e}")))
                .collect::<Result<_, String>>()?,
        };
        let caps = text(caps)?;
        let caps = u64::from_str_radix(caps.trim_start_matches("0x"), 16)
            .map_err(|e| format!("caps {caps:?}: {e}"))?;
        let read_only = match text(mode)?.as_str() {
            "ro" => true,
            "rw" => false,
            m => return Err(format!("mode {m:?} is neither ro nor rw")),
        };
        Ok(ServeArgs {
            dir: PathBuf::from(dir),
            uid: num(uid)?,
            gid: num(gid)?,
            groups,
            caps: caps & FILE_CAPS,
            read_only,
        })
    }
}

/// Jails the process (module doc) and serves standard input and output
/// until the guest closes the connection.
pub fn serve(args: &[OsString]) -> Result<(), String> {
    let args = ServeArgs::parse(args)?;
    // The server reopens files through /proc/self/fd: it opens /proc now,
    // before the chroot hides it.
    let mut server = p9::Server::new(
        std::path::Path::new("/"),
        Default::default(),
        Default::default(),
    )
    .map_err(|e| format!("starting the 9p server: {e}"))?;
    jail(&args)?;
    let input = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| format!("standard input: {e}"))?;
    let output = std::io::stdout()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| format!("standard output: {e}"))?;
    let mut reader = BufReader::with_capacity(128 << 10, File::from(input));
    let mut writer = BufWriter::with_capacity(128 << 10, File::from(output));
    loop {
        match server.handle_message(&mut reader, &mut writer) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(format!("serving {}: {e}", args.dir.display())),
        }
    }
}

fn jail(args: &ServeArgs) -> Result<(), String> {
    let dir = &args.dir;
    let shown = dir.display();
    unshare(CloneFlags::CLONE_NEWNS).map_err(|e| format!("a mount namespace: {e}"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| format!("making / private: {e}"))?;
    mount(
        Some(dir),
        dir,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| format!("binding {shown} onto itself: {e}"))?;
    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID;
    flags |= MsFlags::MS_NODEV;
    if args.read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(None::<&str>, dir, None::<&str>, flags, None::<&str>)
        .map_err(|e| format!("remounting {shown} nosuid,nodev: {e}"))?;
    chroot(dir).map_err(|e| format!("chroot {shown}: {e}"))?;
    chdir("/").map_err(|e| format!("chdir /: {e}"))?;
    let sets = CapSets {
        bounding: args.caps & FILE_CAPS,
        effective: args.caps & FILE_CAPS,
        permitted: args.caps & FILE_CAPS,
        inheritable: 0,
        ambient: 0,
    };
    caps::before_setuid(&sets)?;
    let groups: Vec<Gid> = args.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    setgroups(&groups).map_err(|e| format!("setgroups {:?}: {e}", args.groups))?;
    setgid(Gid::from_raw(args.gid)).map_err(|e| format!("setgid {}: {e}", args.gid))?;
    setuid(Uid::from_raw(args.uid)).map_err(|e| format!("setuid {}: {e}", args.uid))?;
    caps::after_setuid(&sets)?;
    // SAFETY: prctl with integer arguments only.
    let r = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if r != 0 {
        return Err(format!("no_new_privs: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_round_trip_and_keep_only_file_capabilities() {
        let args = ServeArgs {
            dir: "/srv/data".into(),
            uid: 1000,
            gid: 1000,
            groups: vec![1000, 2000],
            caps: u64::MAX,
            read_only: true,
        };
        let back = ServeArgs::parse(&args.to_args()).unwrap();
        assert_eq!(back.caps, FILE_CAPS);
        assert_eq!(
            back,
            ServeArgs {
                caps: FILE_CAPS,
                ..args
            }
        );
        let none = ServeArgs {
            groups: Vec::new(),
            read_only: false,
            ..back
        };
        assert_eq!(ServeArgs::parse(&none.to_args()).unwrap(), none);
        let mut bad = none.to_args();
        bad[5] = "rx".into();
        assert!(ServeArgs::parse(&bad).unwrap_err().contains("rx"));
        assert!(ServeArgs::parse(&bad[..3]).is_err());
    }
}
