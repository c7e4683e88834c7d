//! `tally-worker` binary: see the library crate.

fn main() -> std::process::ExitCode {
    tally_shared::service::service_main("tally-worker", tally_worker::run)
}
