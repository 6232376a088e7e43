//! Benchmarks of twig-snapshotter (owned by the snapshotter work).

pub type Error = Box<dyn std::error::Error>;

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: &Args) -> Result<serde_json::Value, Error> {
    Err("the snapshotter benchmark is not written yet".into())
}
