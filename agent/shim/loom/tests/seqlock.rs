//! The table's sequence lock under loom: a reader that gets a grant gets the fields of one
//! write, never a mix of two, in every interleaving with a writer making two writes.

use drum_shim_loom::seqlock;
use loom::sync::atomic::{AtomicU64, Ordering::Relaxed};
use loom::sync::Arc;
use loom::thread;

/// Two fields the writer always writes equal, and the sequence.
#[derive(Default)]
struct Fields {
    seq: AtomicU64,
    a: AtomicU64,
    b: AtomicU64,
}

fn write(f: &Fields, v: u64) {
    let w = seqlock::write_begin(&f.seq);
    f.a.store(v, Relaxed);
    f.b.store(v, Relaxed);
    seqlock::write_end(&f.seq, w);
}

#[test]
fn a_reader_never_mixes_two_writes() {
    loom::model(|| {
        let f = Arc::new(Fields::default());
        let writer = {
            let f = f.clone();
            thread::spawn(move || {
                write(&f, 1);
                write(&f, 2);
            })
        };
        if let Some((generation, (a, b))) =
            seqlock::read(&f.seq, 2, || (f.a.load(Relaxed), f.b.load(Relaxed)))
        {
            assert_eq!(a, b, "a mix of two writes");
            assert_eq!(
                a, generation,
                "the generation counts the writes the values are of"
            );
        }
        writer.join().unwrap();
        assert_eq!(seqlock::generation(&f.seq), 2);
        let (g, v) = seqlock::read(&f.seq, 1, || f.a.load(Relaxed)).unwrap();
        assert_eq!((g, v), (2, 2));
    });
}
