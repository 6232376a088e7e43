//! Twig's VM snapshots as OCI artifacts.
//!
//! A snapshot of a node store ([`twig_store`]) is pushed to an OCI
//! distribution registry as an image manifest (artifactType
//! [`artifact::ARTIFACT_TYPE`]) whose config is its store manifest, whose
//! layers are its artefacts and whose `subject` is its parent's manifest;
//! and pulled back into another node's store. Blobs are content-addressed:
//! a push uploads only what the registry lacks, a pull fetches only the
//! snapshots the store lacks, memory and disks travel as their non-zero
//! pages ([`extents`]) and an incremental snapshot's disks as the pages
//! that differ from its parent's. Digests and sizes are checked as blobs
//! stream in; a pull publishes each snapshot only once it is whole. A lazy
//! pull ([`lazy`]) stages a snapshot without its memory, serves its guest
//! memory page by page by verified range reads while the memory arrives,
//! and publishes the chain once whole.

pub mod artifact;
pub mod client;
pub mod error;
pub mod extents;
pub mod lazy;
mod pagesource;
mod pull;
mod push;
pub mod reference;

pub use client::{Client, Credentials};
pub use error::{Error, Result};
pub use lazy::{pull_lazy, pull_lazy_as, LazyPull, PageSource};
pub use pull::{local_by_digest, pull, pull_as, pulled_id, Pulled, PULLED_PREFIX};
pub use push::{push, Pushed};
pub use reference::Reference;

/// Longest chain of snapshots pushed or pulled.
pub const MAX_CHAIN: usize = 64;
