// Types of gguf.js: a GGUF model file's layout, and Q4_1 tensors widened to Q5_1 (the same weights).

export class GgufError extends Error {
  /** The bytes read end before the header does: a longer read may succeed. */
  readonly truncated: boolean;
}

export const BLOCK: Readonly<Record<number, { name: string; elements: number; bytes: number }>>;

export interface TensorLayout {
  name: string;
  dims: number[];
  type: number;
  typeName: string;
  /** From the start of the data section. */
  offset: number;
  /** null for a block type this does not size. */
  bytes: number | null;
  /** Where the tensor's type field is in the file (its offset follows). */
  infoAt: number;
}

export interface GgufLayout { version: number; alignment: number; dataStart: number; tensors: TensorLayout[] }

/** `buffer` may be the file's start alone when `fileBytes` gives the whole file's length. */
export function readLayout(buffer: ArrayBuffer, options?: { fileBytes?: number }): GgufLayout;
export function hasQ4_1(layout: GgufLayout): boolean;
/** The file with every Q4_1 tensor as Q5_1; the same buffer when it has none. */
export function widenQ4_1(buffer: ArrayBuffer): ArrayBuffer;
