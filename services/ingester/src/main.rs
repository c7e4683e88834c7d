//! `tally-ingester` binary: see the library crate.

fn main() -> std::process::ExitCode {
    tally_shared::service::service_main("tally-ingester", tally_ingester::run)
}
