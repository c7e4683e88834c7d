//! The `tally-bench` binary: see the library.

fn main() -> std::process::ExitCode {
    tally_bench::main()
}
