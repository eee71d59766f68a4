"""The on-disk formats, each read and written in one module: Hugging Face MoE checkpoints (`checkpoint`, with the
per-architecture names in `architectures`), adapter bundles (`bundle`), Huffman-coded expert stores (`store`, over
the code in `huffman` and the C extension's loader `native`), and DeepSeek ESFT adapter folders (`esft_adapter`).
Every reader validates what it reads; a bad file is one EsftError naming it. The formats import the package's
utilities (errors, atomic, jsonfile, units, names), each other and selection's expert config, nothing else."""
