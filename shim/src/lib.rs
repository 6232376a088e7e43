//! `containerd-shim-twig-v2`: containerd's runtime `io.containerd.twig.v2`.
//!
//! One shim process per pod sandbox (grouped like runc's v2 shim); the
//! sandbox's first container makes the pod's VM — a `twig-vmm` process
//! restored from the base template — and every container of the pod runs
//! in it through twig-agent, its rootfs a twig-snapshotter block image on
//! one of the VM's disk slots.

pub mod config;
pub mod error;
pub mod gate;
pub mod labels;
pub mod pod;
pub mod resources;
pub mod restore;
pub mod sandbox;
pub mod server;
pub mod service;
pub mod share_server;
pub mod spec;
pub mod stdio;
pub mod twig_service;
pub mod vm;

pub use error::{Error, Result};
